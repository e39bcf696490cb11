"""Living weights in the engine (docs/slide.md): the pocket's versions, the fact graph, its files, training."""
