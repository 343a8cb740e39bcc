"""Writers of the demo models (random weights, real tokenizer) for serving and tests."""
