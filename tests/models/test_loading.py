"""Checkpoints in every layout we accept, saving, and clear errors for what we do not support."""

import json
import shutil

import pytest
import torch
from builders import build_hf_model, with_pooling
from helpers import DEVICE, TOLERANCE, load_both, max_diff
from sentence_transformers import SentenceTransformer as PlainSentenceTransformer

from st_fastbackend import SentenceTransformer, UnsupportedModelError
from st_fastbackend.engine import weights
from st_fastbackend.engine.weights import CheckpointError
from st_fastbackend.modules import PackedTransformer


def test_save_round_trip(st_model, texts, tmp_path):
    plain, fast = load_both(st_model("qwen3", pooling_mode="weightedmean"))
    fast.max_seq_length = 100
    fast.save(str(tmp_path / "saved"))
    modules = json.loads((tmp_path / "saved" / "modules.json").read_text())
    assert all(m["type"].startswith("sentence_transformers.") for m in modules)
    assert [m["path"] for m in modules][:2] == ["", "1_Pooling"]  # folders named as plain names them
    assert (tmp_path / "saved" / "1_Pooling" / "config.json").is_file()
    reloaded_plain = PlainSentenceTransformer(str(tmp_path / "saved"), device="cpu")  # no trust_remote_code
    reloaded_fast = SentenceTransformer(str(tmp_path / "saved"), backend="fast", device="cpu")
    assert reloaded_plain.max_seq_length == reloaded_fast.max_seq_length == 100
    assert isinstance(reloaded_fast[0], PackedTransformer)
    expected = fast.encode(texts)
    assert max_diff(reloaded_plain.encode(texts), expected) <= TOLERANCE
    assert max_diff(reloaded_fast.encode(texts), expected) == 0


@pytest.mark.parametrize("causal_lm", [False, True], ids=["no prefix", "model. prefix and lm_head"])
def test_sharded_checkpoint_without_modules_json(tmp_path, texts, causal_lm):
    """A bare Hugging Face folder, sharded: plain ST picks lasttoken for *ForCausalLM, mean otherwise."""
    folder = build_hf_model(tmp_path / "hf", "mistral", causal_lm=causal_lm, max_shard_size="60KB")
    assert (folder / "model.safetensors.index.json").is_file()
    plain, fast = load_both(folder)
    assert fast[1].pooling_mode == plain[1].pooling_mode == ("lasttoken" if causal_lm else "mean")
    assert max_diff(plain.encode(texts), fast.encode(texts)) <= TOLERANCE


def test_legacy_pooling_config(st_model, texts, tmp_path):
    legacy = {"word_embedding_dimension": 64, "pooling_mode_cls_token": True, "pooling_mode_mean_tokens": True}
    plain, fast = load_both(with_pooling(st_model("llama", pooling_mode="mean"), tmp_path / "legacy", legacy))
    assert fast[1].pooling_mode == ("cls", "mean")
    assert max_diff(plain.encode(texts), fast.encode(texts)) <= TOLERANCE


def test_bf16_is_close_to_fp32(st_model, texts):
    folder = st_model("qwen2", pooling_mode="mean")
    fp32 = SentenceTransformer(str(folder), backend="fast", device="cpu")
    for key in ("dtype", "torch_dtype"):
        bf16 = SentenceTransformer(str(folder), backend="fast", device="cpu", model_kwargs={key: torch.bfloat16})
        assert bf16[0].model.embed_tokens.weight.dtype == torch.bfloat16
        plain_bf16 = PlainSentenceTransformer(str(folder), device="cpu", model_kwargs={key: torch.bfloat16})
        reference = fp32.encode(texts)
        ours = max_diff(bf16.encode(texts).astype("float32"), reference)
        theirs = max_diff(plain_bf16.encode(texts).astype("float32"), reference)
        assert ours <= 3 * theirs


def edit_config(folder, **changes):
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    "changes, named",
    [
        (dict(model_type="gpt2", architectures=["GPT2Model"]), "'gpt2'"),
        (dict(hidden_act="gelu_made_up"), "hidden_act 'gelu_made_up'"),
        (dict(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 8,
                               "long_factor": [1.0] * 8, "original_max_position_embeddings": 64}), "longrope"),
        (dict(is_causal=False), "is_causal"),
    ],
    ids=["architecture", "activation", "rope", "bidirectional"],
)  # fmt: skip
def test_unsupported_config_is_a_clear_error(tmp_path, changes, named):
    folder = build_hf_model(tmp_path / "hf", "llama")
    edit_config(folder, **changes)
    with pytest.raises(UnsupportedModelError, match=named) as error:
        SentenceTransformer(str(folder), backend="fast", device="cpu")
    assert 'backend="torch"' in str(error.value)


@pytest.mark.parametrize("name", ["tokenizer.json", "modules.json", "tokenizer_config.json", "1_Pooling/config.json"])
def test_a_corrupt_json_file_is_named_with_its_folder(st_model, tmp_path, name):
    """json.loads' error names a position only (the trial: a bare JSONDecodeError)."""
    folder = shutil.copytree(st_model("bert", pooling_mode="mean"), tmp_path / "model")
    (folder / name).write_text('{"truncated": ')
    with pytest.raises(ValueError, match=f"^{name} in the model folder {folder} is not valid JSON .Expecting value"):
        SentenceTransformer(str(folder), backend="fast", device="cpu")


def test_checkpoint_errors_name_the_tensor(tmp_path):
    from safetensors.torch import load_file, save_file

    folder = build_hf_model(tmp_path / "hf", "mistral")
    weights = load_file(folder / "model.safetensors")
    save_file({**weights, "layers.0.extra.weight": torch.zeros(2)}, folder / "model.safetensors")
    with pytest.raises(CheckpointError, match="layers.0.extra.weight"):
        SentenceTransformer(str(folder), backend="fast", device="cpu")
    save_file({k: v for k, v in weights.items() if "layers.1.self_attn.v_proj" not in k}, folder / "model.safetensors")
    with pytest.raises(
        CheckpointError, match=r"layers.1.self_attn.qkv_proj.weight: the checkpoint has parts \[0, 1\]"
    ):
        SentenceTransformer(str(folder), backend="fast", device="cpu")
    save_file({k: v for k, v in weights.items() if k != "norm.weight"}, folder / "model.safetensors")
    with pytest.raises(CheckpointError, match="lacks tensors: \\['norm.weight'\\]"):
        SentenceTransformer(str(folder), backend="fast", device="cpu")
    edit_config(folder, intermediate_size=96)
    save_file(weights, folder / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"layers\.0\.mlp\.\w+_proj\.weight: checkpoint shape"):
        SentenceTransformer(str(folder), backend="fast", device="cpu")
    edit_config(folder, intermediate_size=128)
    k_proj = "layers.1.self_attn.k_proj.weight"
    save_file({**weights, k_proj: weights[k_proj][:, :60].contiguous()}, folder / "model.safetensors")
    # a part of a fused tensor: torch.cat alone would say "Sizes of tensors must match"
    said = r"qkv_proj\.weight: checkpoint shape .*k_proj\.weight \(32, 60\).*the config implies \(128, 64\)"
    with pytest.raises(CheckpointError, match=said):
        SentenceTransformer(str(folder), backend="fast", device="cpu")


def test_weights_are_read_straight_onto_the_models_device(st_model, monkeypatch):
    """Tensor by tensor onto the device, in the model's dtype: a 7B model never passes through host memory.
    (The device half of this means something under `pytest --device cuda`; on the CPU it checks the dtype.)"""
    folder = str(st_model("mistral", pooling_mode="mean"))
    opened = []
    real_open = weights.safe_open

    def safe_open(file, framework, device="cpu"):
        opened.append(device)
        return real_open(file, framework=framework, device=device)

    monkeypatch.setattr(weights, "safe_open", safe_open)
    model = SentenceTransformer(folder, backend="fast", device=DEVICE, model_kwargs={"dtype": torch.bfloat16})
    assert str(torch.device(DEVICE)) in opened and set(opened) <= {"cpu", str(torch.device(DEVICE))}
    assert {(p.device.type, p.dtype) for p in model[0].parameters()} == {(torch.device(DEVICE).type, torch.bfloat16)}
    with pytest.raises(UnsupportedModelError, match="device_map='auto'"):
        SentenceTransformer(folder, backend="fast", model_kwargs={"device_map": "auto"})


def test_other_backends_are_plain_sentence_transformers(st_model, texts):
    folder = st_model("mistral", pooling_mode="mean")
    model = SentenceTransformer(str(folder), backend="torch", device="cpu")
    plain = PlainSentenceTransformer(str(folder), device="cpu")
    assert type(model[0]) is type(plain[0]) and model.get_backend() == "torch"
    assert max_diff(model.encode(texts), plain.encode(texts)) == 0


def test_dtype_default_is_the_checkpoints_as_in_plain(tmp_path):
    """transformers 5 loads a checkpoint in its own dtype unless told otherwise, and plain sentence-transformers
    with it: an fp16 checkpoint runs in fp16, on any device; a dtype given by name is taken as it is."""
    import transformers

    from st_fastbackend.engine.runtime import resolve_dtype

    folder = build_hf_model(tmp_path / "hf", "llama")
    transformers.AutoModel.from_pretrained(folder).to(torch.float16).save_pretrained(folder)
    weight = lambda **kw: SentenceTransformer(str(folder), backend="fast", device="cpu", **kw)[0].model.norm.weight  # noqa: E731
    plain = PlainSentenceTransformer(str(folder), device="cpu")
    assert weight().dtype == next(plain.parameters()).dtype == torch.float16
    assert weight(model_kwargs={"dtype": "auto"}).dtype == torch.float16
    assert weight(model_kwargs={"torch_dtype": "float32"}).dtype == torch.float32
    config = transformers.AutoConfig.from_pretrained(folder)
    config.dtype = None  # no dtype in config.json: the stored weights' dtype, as transformers reads it
    assert resolve_dtype({}, config, "cuda", stored=torch.bfloat16) == torch.bfloat16
    assert resolve_dtype({}, config, "cpu") == torch.float32
