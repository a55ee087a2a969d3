"""Build engines from a model directory and start-up options (shared by the CLI, the services and the tools)."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from specdec.attention import check_backend
from specdec.attention.graph_backend import capture_at_startup
from specdec.config import ModelConfig
from specdec.engine.draft_engine import DraftEngine, SpecConfig
from specdec.engine.target_engine import TargetEngine
from specdec.errors import ConfigError
from specdec.models.loader import load_draft, load_target, resolve_dtype
from specdec.models.token_map import read_token_map
from specdec.serving.engine_args import DEFAULT_PREFILL_CHUNK

log = logging.getLogger(__name__)

CPU_KV_BUDGET_BYTES = 2 << 30
GPU_KV_FRACTION = 0.85
# (field, least value, what 0 means): the counts `validate` checks (the flags' argparse types say the same ranges)
COUNT_FIELDS = (("num_pages", 0, " (0 = size from memory)"), ("max_batch_size", 1, ""),
                ("max_context", 0, " (0 = the model's)"))


@dataclass(frozen=True)
class EngineOptions:
    device: str = "cpu"
    dtype: str = "auto"
    attention_backend: str = "torch"
    page_size: int = 16
    num_pages: int = 0  # 0 = size the pool from memory
    max_batch_size: int = 64
    max_context: int = 0  # 0 = the model's max_position_embeddings
    dummy_weights: bool = False
    simulate_accept_len: float = 0.0  # target only; benchmarking: accepted lengths are simulated
    cuda_graphs: bool = True  # used on CUDA with the flashinfer backend; --disable-cuda-graph turns them off
    token_map: str = ""  # draft only: a token-map file, the EAGLE-1 head's draft vocabulary (models/token_map.py)
    kv_fraction: float = 0.0  # without num_pages on a GPU: the share of free memory the pool takes (0: GPU_KV_FRACTION)
    prefill_chunk_tokens: int = DEFAULT_PREFILL_CHUNK  # target only: a longer prompt is prefilled in parts (0: never)

    def validate(self) -> EngineOptions:
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ConfigError(f"--device must be cpu, cuda or cuda:N, got {self.device!r}")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ConfigError(f"--device {self.device}: no CUDA device is available (use --device cpu)")
        check_backend(self.attention_backend, self.device)
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise ConfigError(f"--page-size must be a power of two, got {self.page_size}")
        self._check_counts()
        return self

    def _check_counts(self) -> None:
        """Each count below its least value, named as a field and as its flag (one message said all three "must
        be positive" for a -1 in one of them, while 0 pages and 0 context are valid)."""
        bad = [f"{name} (--{name.replace('_', '-')}) {getattr(self, name)}: expected >= {least}{zero}"
               for name, least, zero in COUNT_FIELDS if getattr(self, name) < least]
        if bad:
            raise ConfigError("; ".join(bad))


def _num_pages(opts: EngineOptions, bytes_per_page: int, max_context: int) -> int:
    if opts.num_pages:
        return opts.num_pages
    wanted = opts.max_batch_size * (math.ceil(max_context / opts.page_size) + 2)
    if opts.device.startswith("cuda"):
        free, _ = torch.cuda.mem_get_info(torch.device(opts.device))
        return max(1, min(wanted * 4, int(free * (opts.kv_fraction or GPU_KV_FRACTION)) // bytes_per_page))
    return max(1, min(wanted, CPU_KV_BUDGET_BYTES // bytes_per_page))


def _warn_of_limits(pool_name: str, opts: EngineOptions, pages: int, max_context: int) -> None:
    """Settings that start but refuse requests a user would expect served (QA: `--num-pages 1` started SERVING with a
    16-token pool)."""
    if pages * opts.page_size < max_context:
        log.warning("the %s (%d pages of %d tokens) holds less than one request of the whole context (%d tokens): "
                    "longer requests are refused (--num-pages)", pool_name, pages, opts.page_size, max_context)


def build_target(path: str, opts: EngineOptions) -> TargetEngine:
    opts.validate()
    cfg = ModelConfig.from_hf(path)
    max_context = min(opts.max_context or cfg.max_position_embeddings, cfg.max_position_embeddings)
    if opts.max_context > cfg.max_position_embeddings:  # (QA: 10,000,000 was cut to 2048 without a word)
        log.warning("--max-context %d is more than the model's %d positions: serving %d", opts.max_context,
                    cfg.max_position_embeddings, max_context)
    dtype = resolve_dtype(opts.dtype, opts.device)
    model = load_target(path, dtype, opts.device, dummy=opts.dummy_weights)
    itemsize = torch.tensor([], dtype=dtype).element_size()
    per_page = 2 * cfg.num_layers * opts.page_size * cfg.num_kv_heads * cfg.head_dim * itemsize
    pages = _num_pages(opts, per_page, max_context)
    log.info("target KV pool: %d pages of %d tokens (%.1f MiB)", pages, opts.page_size, pages * per_page / 2**20)
    _warn_of_limits("target KV pool", opts, pages, max_context)
    if opts.simulate_accept_len:
        log.warning("SIMULATED ACCEPTANCE (--simulate-accept-len %.2f): outputs are NOT the target model's; "
                    "for benchmarking only", opts.simulate_accept_len)
    graphs = opts.cuda_graphs and opts.device.startswith("cuda") and opts.attention_backend == "flashinfer"
    engine = TargetEngine(model, pages, opts.page_size, opts.attention_backend, max_context, device=opts.device,
                          max_batch_size=opts.max_batch_size, simulate_accept_len=opts.simulate_accept_len,
                          cuda_graphs=graphs, prefill_chunk_tokens=opts.prefill_chunk_tokens)
    if engine.graphs is not None:  # verify shapes are captured on first use (tree sizes come from the draft)
        capture_at_startup(engine.graphs, "target")
    return engine


def build_draft(path: str, target_path: str, spec: SpecConfig, opts: EngineOptions, max_context: int) -> DraftEngine:
    opts.validate()
    spec.validate()
    dtype = resolve_dtype(opts.dtype, opts.device)
    model = load_draft(path, target_path, dtype, opts.device, dummy=opts.dummy_weights)
    if opts.token_map:
        model.restrict_vocab(read_token_map(opts.token_map, model.cfg.vocab_size))
        log.info("draft vocabulary: %d of the target's %d tokens (%s)", model.cfg.draft_vocab_size,
                 model.cfg.vocab_size, opts.token_map)
    cfg = model.cfg
    _check_spec_fits(spec, cfg.draft_vocab_size, max_context, opts.token_map)
    itemsize = torch.tensor([], dtype=dtype).element_size()
    per_page = 2 * opts.page_size * cfg.num_kv_heads * cfg.head_dim * itemsize
    pages = _num_pages(opts, per_page, max_context)
    log.info("draft KV pool: %d pages of %d tokens", pages, opts.page_size)
    _warn_of_limits("draft KV pool", opts, pages, max_context)
    graphs = opts.cuda_graphs and opts.device.startswith("cuda") and opts.attention_backend == "flashinfer"
    engine = DraftEngine(model, spec, pages, opts.page_size, opts.attention_backend, max_context,
                         device=opts.device, cuda_graphs=graphs, max_batch_size=opts.max_batch_size)
    for graphs in (engine.graphs, engine.extend_graphs):
        if graphs is not None:
            capture_at_startup(graphs, "draft")
    return engine


def _check_spec_fits(spec: SpecConfig, draft_vocab: int, max_context: int, token_map: str) -> None:
    """The tree shape against the draft's vocabulary and the context (QA: a topk over a token map's size failed
    start-up with a traceback from torch.topk, or, with calibration off, every request; a num_steps of the context
    length or more started and never speculated)."""
    if spec.topk > draft_vocab:
        where = f"--token-map {token_map}" if token_map else "the draft head"
        raise ConfigError(f"--topk {spec.topk} exceeds the draft vocabulary ({draft_vocab} tokens, {where})")
    if spec.num_steps >= max_context:
        raise ConfigError(f"--num-steps {spec.num_steps} must be below the context length ({max_context})")
