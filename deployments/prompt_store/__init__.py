"""The disk prompt-state store (docs/store.md): one actor per node owns the folder's pieces, hashes, caps,
eviction and permissions; engines reach it through one `StoreLink`."""
