"""The Hugging Face layer: what fastload does for transformers models and nothing else needs."""
