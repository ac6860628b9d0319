"""GGUF files: llama.cpp's format read in Hugging Face terms, its blocks as the engine's codes, imported."""
