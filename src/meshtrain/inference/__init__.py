"""Using a trained model: whole-model loading in one process and text generation at any layout."""
