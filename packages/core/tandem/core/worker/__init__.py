"""One worker per device: its thread, its pipeline lanes (host thread + stream + stager)
and the step-runner interface every product implements."""
