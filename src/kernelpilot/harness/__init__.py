"""The judge of candidates: a GPU worker process runs build, verify and bench; `judge.Judge` is the API callers use."""
