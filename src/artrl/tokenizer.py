"""`get_tokenizer`: a model's tokenizer as ART 0.5.23 loads it (`art.get_tokenizer`, ART's path `art.tokenizer`).

The loading lives with the rest of what a base model is, in models/tokenizer.py.
"""

from .models.tokenizer import TRUST_REMOTE_CODE_ENV, get_tokenizer

__all__ = ["TRUST_REMOTE_CODE_ENV", "get_tokenizer"]
