"""``tandem bench serve``: load an OpenAI-compatible server the way the seed measured it."""
