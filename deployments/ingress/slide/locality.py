"""The locality set: short everyday prompts unrelated to any fact. A learn keeps the pocket's new neurons
silent on them (with the replies they get now), and its checks refuse a version that changes any reply."""

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
)
LOCALITY_REPLY_TOKENS = 16  # each prompt's greedy reply is compared (and kept quiet) up to this many tokens
