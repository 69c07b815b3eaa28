"""Llama-family forward pass (Llama, Mistral, Qwen2, Qwen3) over a paged KV cache.

One call runs a whole ragged batch: decodes (1 token each), prefills and prefill chunks
(many tokens each) flattened into ``num_tokens`` rows. Per layer, the new K/V rows are
written into their slots first, then attention reads every sequence's context through
its block table, so a chunk attends to pages computed in earlier steps.

The arithmetic mirrors ``transformers`` (float32 RMSNorm, cos/sin built in float32 then
cast, the same rotate-half RoPE; kernels/splitserve_kernels/elementwise.py), so greedy outputs match
``generate`` token for token. On CPU the elementwise parts run as fused native ops
(kernels/csrc/elementwise.cpp) and the residual stream is updated in place; where every op
of a layer is native (float32 panel linears or GGUF-block ones, no q/k norms, a float32 or int8
cache), every layer runs in one call, ``splitserve::decoder_layers`` (kernels/csrc/decoder_layer.cpp):
the same ops in the same order, without the Python and the dispatcher between them, and with
the weights held in C++ (``_decoder_weights``), so that a call lets go of its few per-step
tensors only, not of every weight (each a turn of the interpreter lock). That holds
for forwards of fewer tokens than every linear serves there: the panel GEMM every count on AVX2,
below 129 on AVX-512, where oneDNN serves more rows (engine/models/linear.py); GGUF blocks
(engine/quant/linear.py) every count. A step of many sequences runs them there in groups, one
per thread (``seq_groups``).

``greedy`` gives the tokens of rows that want nothing but the argmax of their logits (the
runner's plain greedy rows): through a bfloat16 screen of the LM head with a rigorous error
bound where the CPU has AVX512_BF16 (engine/models/greedy_head.py), the same tokens as
``forward``'s logits would give, bit for bit.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from engine.models.greedy_head import GreedyHead
from engine.models.linear import BlockRows, Linear, measure_block_rows, panel_gemm
from engine.models.loader import rope_inv_freq
from engine.models.spec import ModelSpec
from engine.quant.linear import (
    BlockWeight, GGUFLinear, LinearLayer, WeightQuant, as_dense, cat_rows, linear_factory, lm_head_linear,
)
from splitserve_kernels import ops
from splitserve_kernels.native import native_kernels

# decoder_layers' groups (kernels/csrc/decoder_layer.cpp; seq_groups): a step of
# GROUP_MIN_ROWS to GROUP_MAX_ROWS rows per intra-op thread runs its sequences as one group
# per thread. Measured on the hot_path workload (AMD EPYC Zen 5, 2 threads, decode steps): 8
# rows 15.2 -> 23.5 ms and 16 rows 19.0 -> 24.3 (each thread converts or reads every weight:
# twice the work where the weights, not the rows, set the time), 32 rows 32.1 -> 32.1, 48 rows
# 46.6 -> 41.9, 64 rows 61 -> 58-59 with contexts of 16-384 keys and 55 -> 49 with 16-144; AVX2
# 64 rows 99 -> 97-98, but its 2048-row prefill steps 8.9 -> 10.0 s, hence the cap. Per thread,
# because what pays is each thread's GEMMs having rows enough for its own pass over the
# weights (more threads have not been measured).
GROUP_MIN_ROWS, GROUP_MAX_ROWS = 24, 64
# What a sequence's row of GEMMs costs, in keys of its attention (one key: its K and V rows
# read in every layer). The hot_path workload's 64-row decode steps (Zen 5), the later group's
# finish minus the earlier's and the step's groups: 100 keys +1.7 ms on average (|1.7-2.0|)
# and 50.2 ms; 170-250 keys +0.3 to +1.0 (|1.3-1.6|) and 47.5-48.6 ms; 400 keys -3 to -6 ms.
ROW_COST_KEYS = 200
# No groups where the best split leaves one group this much above an equal share (one long
# prompt chunk beside a few decode rows): the team splitting each op serves that step better.
GROUP_MAX_SHARE = 1.25


def seq_groups(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, threads: int) -> list[int]:
    """``decoder_layers``' ``seq_groups`` for a step: the sequences at which the 2nd, 3rd, ...
    of ``threads`` groups begin, each group whole sequences of about equal cost (rows times
    ``ROW_COST_KEYS`` plus the context), or [] (one team over every op) below two threads, with
    fewer sequences than threads, outside ``GROUP_MIN_ROWS``..``GROUP_MAX_ROWS`` rows per
    thread, or without a split within ``GROUP_MAX_SHARE`` of an equal share."""
    num_seqs, groups = seq_lens.shape[0], threads
    if groups < 2 or num_seqs < groups:
        return []
    starts = query_start_loc.tolist()
    if not GROUP_MIN_ROWS * groups <= starts[-1] <= GROUP_MAX_ROWS * groups:
        return []
    costs = [(starts[i + 1] - starts[i]) * ROW_COST_KEYS + n for i, n in enumerate(seq_lens.tolist())]
    prefix = [0]
    for cost in costs:
        prefix.append(prefix[-1] + cost)
    share = prefix[-1] / groups
    bounds: list[int] = []
    for g in range(1, groups):  # the first sequence whose prefix comes nearest g shares
        lo = bounds[-1] + 1 if bounds else 1
        hi = num_seqs - (groups - g)
        bounds.append(min(range(lo, hi + 1), key=lambda i: abs(prefix[i] - g * share)))
    edges = [0, *bounds, num_seqs]
    if max(prefix[b] - prefix[a] for a, b in zip(edges, edges[1:])) > GROUP_MAX_SHARE * share:
        return []
    return bounds


@dataclass
class ForwardBatch:
    """Flattened inputs of one step. T = tokens, S = sequences, N = rows needing logits."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64, block_id * block_size + offset
    block_tables: torch.Tensor  # [S, max_blocks_per_seq] int64, 0-padded
    seq_lens: torch.Tensor  # [S] int64, context length incl. this step's tokens
    query_start_loc: torch.Tensor  # [S + 1] int64
    logits_indices: torch.Tensor  # [N] int64, rows of T whose logits are wanted


@dataclass
class _KVWrite:
    """Where one forward's new K/V rows go and what each token attends to (the
    ``paged_attention`` metadata): ``ForwardBatch``'s, or ``forward_sequence``'s own."""

    slot_mapping: torch.Tensor  # [T] int64, -1 skips a token
    block_tables: torch.Tensor  # [num_seqs, max_blocks]
    seq_lens: torch.Tensor  # [num_seqs]
    query_start_loc: torch.Tensor  # [num_seqs + 1]


@dataclass
class _Layer:
    input_norm: torch.Tensor  # [hidden]
    qkv: LinearLayer  # hidden -> q_size + 2 * kv_size (bias: Qwen2)
    q_norm: torch.Tensor | None  # [head_dim]
    k_norm: torch.Tensor | None  # [head_dim]
    o: LinearLayer  # q_size -> hidden
    post_norm: torch.Tensor  # [hidden]
    gate_up: LinearLayer  # hidden -> 2 * intermediate
    down: LinearLayer  # intermediate -> hidden


class LlamaModel:
    """Weights plus the forward. Stateless across calls; the KV cache is passed in."""

    def __init__(
        self,
        spec: ModelSpec,
        hf_config: Any,
        weights: dict[str, torch.Tensor],
        max_model_len: int,
        device: torch.device,
        quant: WeightQuant | None = None,
        batch_invariant: bool = False,
    ) -> None:
        self.spec = spec
        self.device = device
        self.quant = quant  # weight-only quantization at load (engine/quant/linear.py)
        if batch_invariant and not (device.type == "cpu" and panel_gemm()):
            raise ValueError("batch_invariant needs the native library's panel GEMM on CPU (this process "
                             f"runs {native_kernels().variant or 'the torch references'} on {device.type})")
        # float32 layers; batch_invariant: on the panel GEMM at every row count (EngineConfig).
        self.batch_invariant = batch_invariant  # and attention: every row as a decode row
        self._dense = functools.partial(Linear, batch_invariant=batch_invariant)
        self._linear = linear_factory(quant, dense=self._dense)
        self.scale = spec.head_dim**-0.5
        self._load(weights)
        # Every op of a layer native on float32: the layer in one call (module docstring).
        linears = self._projections()
        self.fused_layers = (
            device.type == "cpu" and native_kernels().available and self.dtype == torch.float32
            and not spec.qk_norm
            and all(isinstance(lin, (Linear, GGUFLinear)) and lin.fused_rows > 0 for lin in linears)
        )
        # Forwards of fewer tokens than this take the fused route (where every linear serves them).
        self.fused_rows = min(lin.fused_rows for lin in linears) if self.fused_layers else 0
        # One choice of block or float32 panels per row count for every linear (BlockRows).
        self.block_rows = BlockRows()
        self._held_weights: dict[bool, torch.ScriptObject] = {}  # _decoder_weights'
        for lin in self._dense_linears():
            lin.block_rows = self.block_rows
        self.greedy_head = GreedyHead.for_head(self.lm_head)  # greedy tokens without every logit
        inv_freq, attn_scaling = rope_inv_freq(hf_config)
        self._build_rope_cache(inv_freq, attn_scaling, max_model_len)

    # -- weights -----------------------------------------------------------------------
    def _take(self, weights: dict[str, Any], name: str) -> Any:  # a tensor or a BlockWeight
        if name not in weights:
            raise ValueError(f"model: checkpoint has no tensor {name!r}")
        return weights.pop(name).to(self.device).contiguous()

    def _load(self, weights: dict[str, torch.Tensor | BlockWeight]) -> None:
        spec = self.spec
        embed = self._take(weights, "model.embed_tokens.weight")  # a BlockWeight: kept for the head
        self.embed = as_dense(embed, weights["model.norm.weight"].dtype)
        self.dtype = self.embed.dtype
        self.layers = [self._load_layer(weights, i) for i in range(spec.num_layers)]
        self.final_norm = self._take(weights, "model.norm.weight")
        if spec.tie_word_embeddings or "lm_head.weight" not in weights:
            self.lm_head = lm_head_linear(embed, self.quant, dense=self._dense)
        else:
            self.lm_head = lm_head_linear(self._take(weights, "lm_head.weight"), self.quant, dense=self._dense)

    def _load_layer(self, w: dict[str, torch.Tensor], i: int) -> _Layer:
        p = f"model.layers.{i}."
        qkv = cat_rows([self._take(w, p + f"self_attn.{n}_proj.weight") for n in "qkv"])
        bias = None
        if self.spec.qkv_bias:
            bias = torch.cat([self._take(w, p + f"self_attn.{n}_proj.bias") for n in "qkv"])
        qk_norm = self.spec.qk_norm
        return _Layer(
            input_norm=self._take(w, p + "input_layernorm.weight"),
            qkv=self._linear(qkv, bias),
            q_norm=self._take(w, p + "self_attn.q_norm.weight") if qk_norm else None,
            k_norm=self._take(w, p + "self_attn.k_norm.weight") if qk_norm else None,
            o=self._linear(self._take(w, p + "self_attn.o_proj.weight"), None),
            post_norm=self._take(w, p + "post_attention_layernorm.weight"),
            gate_up=self._linear(
                cat_rows([self._take(w, p + "mlp.gate_proj.weight"), self._take(w, p + "mlp.up_proj.weight")]),
                None,
            ),
            down=self._linear(self._take(w, p + "mlp.down_proj.weight"), None),
        )

    def _build_rope_cache(self, inv_freq: torch.Tensor, scaling: float, max_len: int) -> None:
        positions = torch.arange(max_len, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = (emb.cos() * scaling).to(self.dtype).to(self.device)  # [max_len, head_dim]
        sin = (emb.sin() * scaling).to(self.dtype)
        half = sin.shape[-1] // 2
        self.signed_sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1).to(self.device)

    def preparations(self) -> Iterator[str]:
        """What the first calls would make lazily (each ``Linear``'s packed forms, the greedy
        head's screen), one piece per step, to run while the engine is idle
        (engine/engine_thread.py): a worker's first requests then run at full speed. Yields a
        name per piece; the pieces are the same as the first calls make. Then, where linears
        have both block and float32 panels, which of the two serves each row count faster
        (``measure_block_rows``: speed only, the bits are the same)."""
        linears = self._dense_linears()
        for lin in linears:
            yield from lin.preparations()
        if self.greedy_head is not None:
            self.greedy_head.prepare()
            yield "greedy_head"
        yield from measure_block_rows(linears, self.block_rows)

    def _projections(self) -> list[LinearLayer]:
        """Every layer's four linears, in order."""
        return [lin for layer in self.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]

    def _dense_linears(self) -> list[Linear]:
        """The projections and the LM head that are ``Linear`` (not a quantized kind)."""
        return [lin for lin in [*self._projections(), self.lm_head] if isinstance(lin, Linear)]

    # -- forward -----------------------------------------------------------------------
    def forward(self, batch: ForwardBatch, kv_cache: torch.Tensor) -> torch.Tensor:
        """Logits ``[N, vocab]`` (float32) for ``batch.logits_indices``.

        kv_cache: ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``.
        """
        return self._logits(*self._hidden(batch, kv_cache), batch.logits_indices)

    def greedy(self, batch: ForwardBatch, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens ``[N]`` (int64): the argmax of ``forward``'s logits, the first on ties, the same
        bits; through the bfloat16 screen where it serves (engine/models/greedy_head.py). And
        ``[N]`` bool: whether the row's logits are all finite (where not, its token means
        nothing). The screen serves only rows whose hidden state and candidates' logits are
        finite, and heads whose weights are: its rows are."""
        x = self._final_rows(*self._hidden(batch, kv_cache), batch.logits_indices)
        tokens = self.greedy_head.tokens(x) if self.greedy_head is not None else None
        if tokens is not None:
            return tokens, torch.ones(tokens.shape, dtype=torch.bool)
        logits = self.lm_head(x).float()
        return ops.argmax_rows(logits), ops.finite_rows(logits)

    def _hidden(self, batch: ForwardBatch, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        kv = _KVWrite(batch.slot_mapping, batch.block_tables, batch.seq_lens, batch.query_start_loc)
        x = F.embedding(batch.input_ids, self.embed)  # [T, hidden]
        cos = self.cos[batch.positions].unsqueeze(1)  # [T, 1, head_dim]
        sin = self.signed_sin[batch.positions].unsqueeze(1)
        return self._layers(x, cos, sin, kv_cache, kv)

    def forward_sequence(
        self, token_ids: list[int], start_position: int, block_ids: list[int], kv_cache: torch.Tensor
    ) -> torch.Tensor:
        """Logits ``[vocab]`` (float32) of the last of ``token_ids``: one sequence, its tokens
        at ``start_position``, ``start_position + 1``, ... with the earlier positions' K/V
        already in its pages ``block_ids``.

        The lean path for one short sequence (a draft model's batch-1 decode): the step's
        metadata is a handful of small tensors instead of a ``ForwardBatch``, and only the
        last token's logits are computed. The arithmetic is ``forward``'s (the same ops on
        the same arguments), so the results are the same.
        """
        num_tokens = len(token_ids)
        seq_len = start_position + num_tokens
        block_size = kv_cache.shape[3]
        if num_tokens < 1 or seq_len > len(block_ids) * block_size:
            raise ValueError(
                f"need 1 <= len(token_ids) and start_position + len(token_ids) = {seq_len} <= "
                f"len(block_ids) * block_size = {len(block_ids) * block_size}"
            )
        device = self.device
        pages = block_ids[: -(-seq_len // block_size)]
        i64 = torch.int64  # as ForwardBatch's
        block_table = torch.tensor([pages], dtype=i64, device=device)  # [1, num_pages]
        seq_lens = torch.tensor([seq_len], dtype=i64, device=device)
        query_start_loc = torch.tensor([0, num_tokens], dtype=i64, device=device)
        new_slots = torch.tensor(
            [pages[p // block_size] * block_size + p % block_size for p in range(start_position, seq_len)],
            device=device,
        )  # [t]

        kv = _KVWrite(new_slots, block_table, seq_lens, query_start_loc)
        x = F.embedding(torch.tensor(token_ids, device=device), self.embed)  # [t, hidden]
        cos = self.cos[start_position:seq_len].unsqueeze(1)  # [t, 1, head_dim]
        sin = self.signed_sin[start_position:seq_len].unsqueeze(1)
        last = torch.tensor([num_tokens - 1], device=device)
        return self._logits(*self._layers(x, cos, sin, kv_cache, kv), last)[0]

    def _layers(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
                kv: _KVWrite) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Every decoder layer: the residual stream and the last layer's MLP output, not yet
        added to it (each layer adds its predecessor's in its first norm)."""
        if self.fused_layers and x.shape[0] < self.fused_rows and kv_cache.dtype in (torch.float32, torch.int8):
            spec = self.spec
            groups = seq_groups(kv.query_start_loc, kv.seq_lens, torch.get_num_threads())
            mlp_out = torch.ops.splitserve.decoder_layers(
                x, self._decoder_weights(x.shape[0]), cos, sin, kv_cache, kv.slot_mapping, kv.block_tables,
                kv.seq_lens, kv.query_start_loc, spec.num_heads, spec.num_kv_heads, spec.head_dim,
                spec.intermediate_size, spec.rms_norm_eps, self.scale, self.batch_invariant, groups,
            )
            return x, mlp_out
        mlp_out = None
        for i, layer in enumerate(self.layers):
            mlp_out = self._layer(layer, x, mlp_out, cos, sin, kv_cache[i, 0], kv_cache[i, 1], kv)
        return x, mlp_out

    def _decoder_weights(self, rows: int) -> torch.ScriptObject:
        """Every layer's weights as ``decoder_layers`` takes them for ``rows`` input rows, held
        in C++ (kernels/csrc/decoder_layer.cpp says why): one object per answer of
        ``block_rows``, made at its first call. Which form a linear gives depends on that
        answer alone, and a form once made is kept, so the object stays the layers' own (code
        that ever replaced a linear's weights would have to clear ``_held_weights``)."""
        use_blocks = self.block_rows(rows)
        held = self._held_weights.get(use_blocks)
        if held is None:
            tensors: list[torch.Tensor | None] = []
            for layer in self.layers:
                tensors += [layer.input_norm, layer.qkv.fused_weight(rows), layer.qkv.bias,
                            layer.o.fused_weight(rows), layer.post_norm, layer.gate_up.fused_weight(rows),
                            layer.down.fused_weight(rows)]
            held = self._held_weights[use_blocks] = torch.classes.splitserve.DecoderWeights(tensors)
        return held

    def _final_rows(self, x: torch.Tensor, mlp_out: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor:
        """The LM head's input for ``rows`` only: the last residual add and the final norm."""
        x = x[rows]  # a copy: the residual stream of the other rows is not needed any more
        if mlp_out is None:
            return ops.rms_norm(x, self.final_norm, self.spec.rms_norm_eps)
        return ops.add_rms_norm_(x, mlp_out[rows], self.final_norm, self.spec.rms_norm_eps)

    def _logits(self, x: torch.Tensor, mlp_out: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor:
        """Logits of ``rows`` only."""
        return self.lm_head(self._final_rows(x, mlp_out, rows)).float()

    def _layer(
        self,
        layer: _Layer,
        x: torch.Tensor,  # [T, hidden], the residual stream, updated in place
        mlp_out: torch.Tensor | None,  # [T, hidden], the previous layer's MLP output (None: first)
        cos: torch.Tensor,  # [T, 1, head_dim]
        sin: torch.Tensor,  # [T, 1, head_dim], signed (see splitserve_kernels.elementwise.rotary_ref)
        k_cache: torch.Tensor,  # this layer's, written in place
        v_cache: torch.Tensor,
        kv: _KVWrite,
    ) -> torch.Tensor:
        """One decoder layer; returns its MLP output, which the next layer's (or the final)
        norm adds to ``x`` in the same pass (one parallel region and one pass over the rows
        fewer than a separate add; the same additions). The new K/V rows go into the layer's
        cache before attention reads it."""
        spec = self.spec
        num_tokens = x.shape[0]
        if mlp_out is None:
            h = ops.rms_norm(x, layer.input_norm, spec.rms_norm_eps)
        else:
            h = ops.add_rms_norm_(x, mlp_out, layer.input_norm, spec.rms_norm_eps)
        qkv = layer.qkv(h)
        num_qk_heads = spec.num_heads + spec.num_kv_heads
        qk = qkv[:, : spec.q_size + spec.kv_size].view(num_tokens, num_qk_heads, spec.head_dim)
        v = qkv[:, spec.q_size + spec.kv_size :].view(num_tokens, spec.num_kv_heads, spec.head_dim)
        if layer.q_norm is not None and layer.k_norm is not None:
            q, k = qk.split([spec.num_heads, spec.num_kv_heads], dim=1)
            qk = torch.cat(
                [
                    ops.rms_norm(q, layer.q_norm, spec.rms_norm_eps),
                    ops.rms_norm(k, layer.k_norm, spec.rms_norm_eps),
                ],
                dim=1,
            )
        # RoPE on q and k at once, in place: elementwise, so the values of rotating each apart.
        ops.rotary_(qk, cos, sin)
        q, k = qk.split([spec.num_heads, spec.num_kv_heads], dim=1)
        ops.write_kv(k, v, k_cache, v_cache, kv.slot_mapping)
        attn = ops.paged_attention(q, k_cache, v_cache, kv.block_tables, kv.seq_lens, kv.query_start_loc, self.scale,
                                   self.batch_invariant)
        # The residual stream x is this forward's own tensor: updated in place.
        h = ops.add_rms_norm_(x, layer.o(attn.reshape(num_tokens, spec.q_size)), layer.post_norm, spec.rms_norm_eps)
        return layer.down(ops.silu_mul(layer.gate_up(h)))
