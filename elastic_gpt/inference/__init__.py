"""Using a trained checkpoint: load it into one process, sample text, export to Hugging Face."""
