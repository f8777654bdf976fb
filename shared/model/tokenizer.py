"""The checkpoint's tokenizer (with its chat template and special tokens), as transformers loads it.

Loaded through the class the checkpoint names (``tokenizer_class`` in ``tokenizer_config.json``), which is
what ``AutoTokenizer`` resolves to, without ``AutoTokenizer`` itself: its import brings in transformers'
configuration stack and with it torch (seconds at every start of a frontend, which needs neither).
"""

from __future__ import annotations

import json
from pathlib import Path


def load_tokenizer(path: str | Path):
    import transformers

    config = Path(path) / "tokenizer_config.json"
    name = json.loads(config.read_text()).get("tokenizer_class", "") if config.is_file() else ""
    tokenizer_class = getattr(transformers, name, None) if name.isidentifier() else None
    if tokenizer_class is None or not hasattr(tokenizer_class, "from_pretrained"):
        from transformers import AutoTokenizer  # a class this transformers does not export by that name

        tokenizer_class = AutoTokenizer
    return tokenizer_class.from_pretrained(str(path))
