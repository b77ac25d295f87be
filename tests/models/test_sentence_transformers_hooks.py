"""The private sentence-transformers hooks the fast backend overrides or calls. pyproject pins
sentence-transformers below 7; if a release within that range renames one, this test names it."""

import sentence_transformers
from builders import build_st_model
from sentence_transformers.base.modules import Transformer

import st_fastbackend
from st_fastbackend.models.fast import fast_method

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


def test_with_another_backend_every_override_is_the_parents_own(tmp_path):
    """A model class loaded with backend="torch" is exactly sentence-transformers' class: each hook the fast backend
    overrides (a fast_method) resolves to the parent's function; with "fast", to ours. A user's subclass keeps its
    own methods under either backend."""
    folder = str(build_st_model(tmp_path / "bert", "bert"))

    class Mine(st_fastbackend.SentenceTransformer):
        def similarity_label(self) -> str:
            return "mine"

    overridden = [name for klass in Mine.__mro__ for name, value in vars(klass).items()
                  if isinstance(value, fast_method)]  # fmt: skip
    assert {"_inference", "_load_default_modules", "save", "get_model_kwargs"} <= set(overridden)
    for backend in ("torch", "fast"):
        model = Mine(folder, backend=backend, device="cpu")
        assert model.similarity_label() == "mine"
        for name in overridden:
            found = getattr(model, name).__func__
            parent = getattr(sentence_transformers.SentenceTransformer, name)
            assert (found is parent) == (backend == "torch"), (backend, name)
