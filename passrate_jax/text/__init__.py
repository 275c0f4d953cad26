"""Text: the character tokenizer, the Hugging Face tokenizer wrapper and chat templates."""
