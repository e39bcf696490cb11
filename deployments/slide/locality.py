"""The locality set: short everyday prompts unrelated to any fact, whose replies no learn may change.

Each is asked with thinking off and as the template has it. A learn keeps the pocket's new neurons silent on them (with the replies they get now), and its checks
refuse a version that changes any reply. Some are shaped like the questions facts get asked, so that a
neuron learns its own question, not the shape of every question."""

LOCALITY_PROMPTS = (
    "Hello! How are you today?",
    "What is two plus two?",
    "Name a color of the sky.",
    "Write one word that rhymes with cat.",
    "What day comes after Monday?",
    "Say thank you in French.",
    "How many legs does a spider have?",
    "What do bees make?",
    "Give me a synonym for happy.",
    "What is the opposite of cold?",
    "Count from one to five.",
    "What sound does a dog make?",
    "What is the capital of Spain?",
    "Who wrote Hamlet?",
    "What is the name of the tallest mountain?",
    "What is the code name of the first moon landing?",
    "Tell me a short story.",
    "Write a Python function that returns the square of a number.",
    "Translate good night into German.",
    "What is my name?",
)
LOCALITY_REPLY_TOKENS = 16  # each prompt's greedy reply is compared (and kept quiet) up to this many tokens
