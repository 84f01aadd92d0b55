"""``hybridkv bench serve``: a benchmark client for OpenAI-compatible servers (ours, vLLM, SGLang).

``datasets`` makes prompts of exact token lengths, ``client`` streams requests and times them,
``metrics`` aggregates, ``report`` prints the table and writes the JSON and the plot.
"""
