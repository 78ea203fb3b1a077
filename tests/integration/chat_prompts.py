"""Everyday chat questions the integration tests send through real services."""

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Give me three tips for writing clear code.",
    "Explain in two sentences why the sky is blue.",
    "What is 17 times 23?",
    "Name three planets of the solar system.",
    "How do I boil an egg?",
    "Translate 'good morning' into Spanish.",
]
