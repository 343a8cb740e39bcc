"""``tandem bench serve``: load an OpenAI-compatible server the way xLLM pull request #1894
measured it."""
