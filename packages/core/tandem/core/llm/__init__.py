"""The LLM product: engine and its loop, scheduler, requests, sampling, tokenizer and
detokenizer, step inputs, attention metadata and the step runner of decoder models."""
