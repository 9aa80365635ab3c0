"""The models that ``ptxforge compile-report``, ``precompile --model`` and ``bench model``
name (``build``): the FFN block, transformers' Llama with Llama-3-8B layer sizes,
DeepSeek-V3's and Mixtral's MoE blocks, or any transformers config, each a ``Case``: the
model with random weights (N(0, 0.02), as the models' own init) and its inputs for a
token count. ``export_onnx`` writes such a model as torch.onnx.export does, for the ONNX
front end."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable

import torch


class Ffn(torch.nn.Module):
    """The FFN block ``x + down(silu(g) * u)`` with ``g, u = gate_up(RMSNorm(x)).chunk(2)``
    (DeepSeek's dense FFN at hidden 7168, intermediate 2048)."""

    def __init__(self, hidden: int = 7168, inter: int = 2048):
        super().__init__()
        self.norm = torch.nn.RMSNorm(hidden, eps=1e-6)
        self.gate_up = torch.nn.Linear(hidden, 2 * inter, bias=False)
        self.down = torch.nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        g, u = self.gate_up(self.norm(x)).chunk(2, -1)
        return x + self.down(torch.nn.functional.silu(g) * u)


def in_f32(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` computing in f32: the numerics reference for its bf16 self.
    torch's grouped GEMM takes bf16 alone: the copy's MoE experts loop over the experts
    (transformers' "eager" experts implementation)."""
    reference = copy.deepcopy(model).float()
    for module in reference.modules():
        config = getattr(module, "config", None)
        if getattr(config, "_experts_implementation", None) == "grouped_mm":
            config._experts_implementation = "eager"
    return reference


# Llama-3-8B's layer sizes.
LLAMA_8B = {"hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
            "num_key_value_heads": 8, "vocab_size": 128256, "rms_norm_eps": 1e-5,
            "max_position_embeddings": 8192, "rope_theta": 500000.0}


# DeepSeek-V3's MoE layer and Mixtral-8x7B's (transformers' config names).
DEEPSEEK_V3_MOE = {"hidden_size": 7168, "moe_intermediate_size": 2048, "n_routed_experts": 256,
                   "num_experts_per_tok": 8, "n_shared_experts": 1, "n_group": 8,
                   "topk_group": 4, "intermediate_size": 18432}
MIXTRAL_MOE = {"hidden_size": 4096, "intermediate_size": 14336, "num_local_experts": 8,
               "num_experts_per_tok": 2}


@dataclass
class Case:
    """A model and how to call it for a number of tokens."""
    name: str
    model: torch.nn.Module
    inputs: Callable        # (tokens, device) -> (args, kwargs)
    hidden: int
    # (args) -> a line on what the call does beyond its sizes (a MoE block: its experts
    # the routing activates and their weights' bytes), or None
    describe: Callable | None = None

    def output(self, result) -> torch.Tensor:
        """The tensor a call returns (transformers' models return an output object)."""
        return getattr(result, "last_hidden_state", result)


def _init(model: torch.nn.Module) -> torch.nn.Module:
    """Weights from N(0, 0.02), norms' weights from N(1, 0.1): every parameter drawn (a
    module built on the meta device or without init holds garbage)."""
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.device.type == "meta":
                continue
            if parameter.dim() == 1:
                parameter.normal_(1.0, 0.1)
            else:
                parameter.normal_(0.0, 0.02)
    return model


def _transformers():
    try:
        import transformers
    except ImportError:
        raise ValueError("a transformers model needs the transformers package: pip install "
                         "transformers") from None
    return transformers


def ffn(hidden: int = 7168, inter: int = 2048) -> Case:
    model = _init(Ffn(hidden, inter)).to(torch.bfloat16)
    inputs = lambda tokens, device: ((torch.randn(tokens, hidden, device=device,
                                                  dtype=torch.bfloat16),), {})
    return Case(f"FFN {hidden}/{inter}", model, inputs, hidden)


def transformers_model(config, layers: int | None = None, name: str | None = None) -> Case:
    """transformers' base model (no LM head) for ``config`` (a config object, or a path to
    a config.json), ``layers`` layers, SDPA attention, bf16, called on token ids."""
    transformers = _transformers()

    if not isinstance(config, transformers.PretrainedConfig):
        config = transformers.AutoConfig.from_pretrained(config)
    config = copy.deepcopy(config)
    if layers is not None:
        config.num_hidden_layers = layers
    config._attn_implementation = "sdpa"
    model = _init(transformers.AutoModel.from_config(config, dtype=torch.bfloat16)).eval()
    vocab = config.vocab_size

    def inputs(tokens, device):
        ids = torch.randint(0, vocab, (1, tokens), device=device)
        return (ids,), {"use_cache": False}

    label = name or f"{type(model).__name__}"
    layers = config.num_hidden_layers
    return Case(f"{label}, {layers} layer{'s' * (layers != 1)}", model, inputs, config.hidden_size)


def llama_8b(layers: int = 2) -> Case:
    transformers = _transformers()
    return transformers_model(transformers.LlamaConfig(**LLAMA_8B), layers, "Llama-3-8B sizes")


def moe_block(kind: str, *, experts_implementation: str = "grouped_mm", device=None,
              **sizes) -> Case:
    """transformers' MoE block of DeepSeek-V3 ("deepseek-v3-moe": 256 experts, top-8 of
    4 groups of 8, one shared expert) or Mixtral ("mixtral-moe": 8 experts, top-2) at the
    models' sizes (``sizes``: config entries to change), its experts run by
    ``experts_implementation="grouped_mm"`` (torch's grouped GEMM: the fastest
    transformers has, and the form the ptxforge backend lowers), built on ``device``, every
    weight from N(0, 0.02) (but on the meta device): a block built without init routes every
    token to the same few experts. Called on hidden states [1, T, H]."""
    transformers = _transformers()
    if kind == "deepseek-v3-moe":
        config = transformers.DeepseekV3Config(**{**DEEPSEEK_V3_MOE, **sizes})
        block = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3MoE
        label = "DeepSeek-V3 MoE"
    else:
        config = transformers.MixtralConfig(**{**MIXTRAL_MOE, **sizes})
        block = transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock
        label = "Mixtral MoE"
    config._experts_implementation = experts_implementation
    if device is None:   # the ambient default (meta, for the report), else the GPU if any:
        ambient = torch.get_default_device()   # drawing 11 G weights on the CPU takes minutes
        device = ambient if ambient.type != "cpu" else \
            ("cuda" if torch.cuda.is_available() else "cpu")
    with torch.device(device):
        model = block(config).to(torch.bfloat16).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.device.type != "meta":
                parameter.normal_(0.0, 0.02)
    hidden = config.hidden_size
    inner = getattr(config, "moe_intermediate_size", config.intermediate_size)
    inputs = lambda tokens, device: ((torch.randn(1, tokens, hidden, device=device,
                                                  dtype=torch.bfloat16),), {})

    def describe(args) -> str:
        with torch.no_grad():
            active = model.gate(args[0])[2].unique().numel()
        experts = model.experts.gate_up_proj.shape[0]
        weight_bytes = active * 3 * inner * hidden   # FP8 gate, up and down
        return f"{active} of {experts} experts active, {weight_bytes / 1e9:.2f} GB of FP8 weights"

    return Case(label, model, inputs, hidden, describe)


class TokensToHidden(torch.nn.Module):
    """A transformers base model called on token ids alone, without a cache, returning its
    hidden states: one tensor in and one out, as torch.onnx.export takes a model."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(ids, use_cache=False).last_hidden_state


def export_onnx(model: torch.nn.Module, path, opset: int, *, external_data: bool = False) -> None:
    """transformers' base ``model`` as torch.onnx.export (the dynamo exporter) writes it at
    ``opset`` to ``path``: token ids [1, seq] in, hidden states out, seq a dynamic axis;
    ``external_data``: the weights in a file beside it (models over 2 GB need it)."""
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (1, 8), device=next(model.parameters()).device)
    program = torch.onnx.export(TokensToHidden(model).eval(), (ids,), dynamo=True,
                                opset_version=opset, verbose=False,
                                dynamic_shapes=({1: torch.export.Dim("seq")},))
    program.save(str(path), external_data=external_data)


# The models ``build`` knows by name; any other name is the path of a config.json.
BUILT_IN = ("ffn", "llama-8b", "deepseek-v3-moe", "mixtral-moe")


def build(name: str, layers: int = 2) -> Case:
    """One of ``BUILT_IN``, or the path of a transformers config.json."""
    if name == "ffn":
        return ffn()
    if name == "llama-8b":
        return llama_8b(layers)
    if name in ("deepseek-v3-moe", "mixtral-moe"):
        return moe_block(name)
    if name.endswith(".json") or "/" in name:
        return transformers_model(name, layers)
    raise ValueError(f"model must be {', '.join(BUILT_IN)} or a transformers config.json, "
                     f"got {name!r}")
