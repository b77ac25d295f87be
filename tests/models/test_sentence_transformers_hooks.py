"""The private sentence-transformers hooks the fast backend overrides or calls. pyproject pins
sentence-transformers below 7; if a release within that range renames one, this test names it."""

import sentence_transformers
from sentence_transformers.base.modules import Transformer

HOOKS = {
    sentence_transformers.SentenceTransformer: [
        "_inference",  # the encode() loop replaced by the packed one
        "_multi_process",  # checks inputs before chunking
        "_load_module_class_from_ref",  # swaps Transformer and Pooling for the packed modules
        "_load_default_modules",  # a bare Hugging Face checkpoint
        "_resolve_inference_device",
        "_resolve_prompt",  # the server resolves prompts as encode() does
    ],
    Transformer: ["_load_init_kwargs"],  # reads sentence_bert_config.json for PackedTransformer
}


def test_the_private_hooks_we_rely_on_exist():
    version = sentence_transformers.__version__
    for owner, names in HOOKS.items():
        for name in names:
            missing = f"sentence-transformers {version} has no {owner.__name__}.{name}"
            assert callable(getattr(owner, name, None)), missing
