from tiny_models import tiny_model  # noqa: F401  (the fixture)
