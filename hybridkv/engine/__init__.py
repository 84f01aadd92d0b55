"""Sequences, scheduler, sampler and the offline ``LLM`` API."""
