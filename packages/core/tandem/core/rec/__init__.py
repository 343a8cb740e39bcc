"""The generative-recommendation product: service, engine loop, fixed-steps scheduler,
requests, steps, the step runner, constrained beam search and the item catalog."""
