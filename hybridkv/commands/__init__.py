"""One module per ``hybridkv`` subcommand."""


def plain_text(doc: str) -> str:
    """A module docstring's first line as help text: reST's double backticks dropped."""
    return doc.strip().splitlines()[0].replace("``", "")
