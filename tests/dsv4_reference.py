"""An independent, plain re-implementation of DeepSeek-V4's DSpark drafter forward, for tests/test_dsv4.py (not a
test module). It imports nothing from draft_model/: it reads weights by the DeepSeek-V4 checkpoint's names
(`mtp.<stage>.*`, as conversion/deepseek.py and vLLM load them) and computes one block at a time, token by token
where the engines do, in the engines' own layouts:

- hyper-connections as llama.cpp's deepseek4.cpp `build_hc_pre` / `build_hc_sinkhorn` / `build_hc_post` /
  `build_hc_head` (the 24 mixes = pre 4 | post 4 | comb 16, comb element (dst, src) at flat index dst + 4 src;
  softmax over dst, + eps, one column (src) normalisation, then (iters-1) x (row, column), eps in denominators);
- attention as deepseek4.cpp `build_attention_impl`: wq_a -> q_norm -> wq_b -> weightless per-head RMS -> RoPE
  NORM mode (adjacent pairs) on the trailing rope dims; wkv -> kv_norm -> RoPE; kv is K and V; scale 1/sqrt(E);
  per-head sink in the softmax; output de-rotated (rope_ext_back); wo_a per group, wo_b. RoPE here goes through
  complex numbers, as DeepSeek's own `apply_rotary_emb` does;
- the context as dflash.cpp's embd batch: main_x = main_norm(main_proj(feats)), each stage's kv of it at the row's
  own position; the window per DeepSeek's reference (every slot sees [p - W, p)), or llama.cpp's per-query mask
  (`llamacpp_window=True`: key position p0 visible to the query at p1 iff p1 - p0 < n_swa, with n_swa = W + 1);
- the MoE as llama-graph.cpp `build_moe_ffn` with sqrt-softplus gating: top-k of prob + bias, weights the
  unbiased probs renormalised and scaled; shared experts added; SwiGLU with ggml's swiglu_clamp
  (silu(min(gate, L)) * clamp(up, -L, L), ggml-cpu ops.cpp) where the limit L > 0;
- the heads as dflash.cpp: hc_head -> (confidence input) -> output_norm -> LM head; Markov bias W2 W1[prev];
  confidence sigmoid(proj [h_pre ; W1[prev]]) (returned as a logit).
"""

from __future__ import annotations

import math

import torch


def rms(x: torch.Tensor, eps: float, weight: torch.Tensor | None = None) -> torch.Tensor:
    y = x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)
    return y if weight is None else y * weight


def rope(x: torch.Tensor, pos: int, rd: int, theta: float, inverse: bool = False) -> torch.Tensor:
    """DeepSeek's apply_rotary_emb on the last `rd` dims of x [..., E]: pairs as complex numbers times e^{i pos f}."""
    freqs = 1.0 / theta ** (torch.arange(0, rd, 2, dtype=torch.float64) / rd)
    cis = torch.polar(torch.ones(rd // 2, dtype=torch.float64), pos * freqs)
    if inverse:
        cis = cis.conj()
    z = torch.view_as_complex(x[..., -rd:].double().reshape(*x.shape[:-1], rd // 2, 2).contiguous())
    rotated = torch.view_as_real(z * cis).reshape(*x.shape[:-1], rd).to(x.dtype)
    return torch.cat([x[..., :-rd], rotated], dim=-1)


def hc_pre(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hp: dict):
    """One token's streams x [4, D] -> (h [D], post [4], comb [dst][src] as a 4x4 tensor indexed c[dst, src])."""
    hc, eps, hc_eps = x.shape[0], hp["rms_norm_eps"], hp["hc_eps"]
    flat = x.reshape(-1)
    mixes = fn @ rms(flat, eps)
    pre = torch.sigmoid(mixes[:hc] * scale[0] + base[:hc]) + hc_eps
    post = 2 * torch.sigmoid(mixes[hc:2 * hc] * scale[1] + base[hc:2 * hc])
    logits = mixes[2 * hc:] * scale[2] + base[2 * hc:]
    c = torch.empty(hc, hc, dtype=x.dtype)
    for src in range(hc):  # ggml [dst, src]: flat index dst + hc * src
        for dst in range(hc):
            c[dst, src] = logits[dst + hc * src]
    # softmax over dst for each src, + eps
    for src in range(hc):
        c[:, src] = torch.softmax(c[:, src], dim=0) + hc_eps

    def norm_cols():  # for each dst, sum over src
        for dst in range(hc):
            c[dst, :] = c[dst, :] / (c[dst, :].sum() + hc_eps)

    def norm_rows():  # for each src, sum over dst
        for src in range(hc):
            c[:, src] = c[:, src] / (c[:, src].sum() + hc_eps)

    norm_cols()
    for _ in range(hp["hc_sinkhorn_iters"] - 1):
        norm_rows()
        norm_cols()
    h = sum(pre[i] * x[i] for i in range(hc))
    return h, post, c


def hc_post(f: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    hc = residual.shape[0]
    out = []
    for dst in range(hc):
        cur = f * post[dst]
        for src in range(hc):
            cur = cur + residual[src] * c[dst, src]
        out.append(cur)
    return torch.stack(out)


def moe(x: torch.Tensor, w: dict, pre: str, hp: dict) -> torch.Tensor:
    """One token x [D] through sqrt-softplus routing, the routed experts and the shared experts."""
    logits = w[pre + "ffn.gate.weight"] @ x
    probs = torch.sqrt(torch.nn.functional.softplus(logits))
    chosen = torch.topk(probs + w[pre + "ffn.gate.bias"], hp["top_k"]).indices.tolist()
    weights = probs[chosen]
    weights = weights / weights.sum() * hp["routed_scaling_factor"]

    def swiglu(w1, w3, w2):  # with swiglu_limit > 0, ggml_swiglu_clamp: silu(min(g, L)) * clamp(u, -L, L)
        g, u, limit = w1 @ x, w3 @ x, hp["swiglu_limit"]
        if limit > 0:
            g = torch.minimum(g, torch.tensor(limit))
            u = torch.maximum(torch.minimum(u, torch.tensor(limit)), torch.tensor(-limit))
        return w2 @ (torch.nn.functional.silu(g) * u)

    y = torch.zeros_like(x)
    for j, e in enumerate(chosen):
        p = f"{pre}ffn.experts.{e}."
        y = y + weights[j] * swiglu(w[p + "w1.weight"], w[p + "w3.weight"], w[p + "w2.weight"])
    p = pre + "ffn.shared_experts."
    return y + swiglu(w[p + "w1.weight"], w[p + "w3.weight"], w[p + "w2.weight"])


def attention(xs: torch.Tensor, ctx_keys: list[tuple[int, torch.Tensor]], block_pos: list[int], w: dict, pre: str,
              hp: dict, llamacpp_window: bool) -> torch.Tensor:
    """The block's normed inputs xs [K, D] -> attention outputs [K, D]. ctx_keys: (position, rotated kv [E]) of
    every context row in the block's window [p - W, p)."""
    H, E, rd, theta, eps = hp["num_heads"], hp["head_dim"], hp["rope_head_dim"], hp["rope_theta"], hp["rms_norm_eps"]
    G = hp["o_groups"]
    a = pre + "attn."
    block_keys = []
    for x, pos in zip(xs, block_pos):
        kv = rms(w[a + "wkv.weight"] @ x, eps, w[a + "kv_norm.weight"])
        block_keys.append((pos, rope(kv, pos, rd, theta)))
    outs = []
    for x, pos in zip(xs, block_pos):
        q = w[a + "wq_b.weight"] @ rms(w[a + "wq_a.weight"] @ x, eps, w[a + "q_norm.weight"])
        q = torch.stack([rope(rms(q[h * E:(h + 1) * E], eps), pos, rd, theta) for h in range(H)])
        if llamacpp_window:
            keys = [(p0, k) for p0, k in ctx_keys if pos - p0 < hp["sliding_window"] + 1] + block_keys
        else:
            keys = ctx_keys + block_keys
        K = torch.stack([k for _, k in keys])  # [L, E], also the values
        heads = []
        for h in range(H):
            s = K @ q[h] / math.sqrt(E)
            s = torch.cat([s, w[a + "attn_sink"][h:h + 1]])
            p = torch.softmax(s, dim=0)[:-1]
            heads.append(rope(p @ K, pos, rd, theta, inverse=True))
        o = torch.cat(heads)  # [H * E], heads in order
        wo_a = w[a + "wo_a.weight"]  # [G * Ro, H * E / G]
        ro, gd = wo_a.shape[0] // G, H * E // G
        oa = torch.cat([wo_a[g * ro:(g + 1) * ro] @ o[g * gd:(g + 1) * gd] for g in range(G)])
        outs.append(w[a + "wo_b.weight"] @ oa)
    return torch.stack(outs)


def draft_block(w: dict, hp: dict, embed_VD: torch.Tensor, lm_head_VD: torch.Tensor, feats_PF: torch.Tensor,
                anchor_id: int, prev_ids: list[int], llamacpp_window: bool = False) -> dict[str, torch.Tensor]:
    """One block with its anchor at position p = len(feats_PF) (feats_PF: the concatenated target features of
    positions 0..p-1 of its sequence). prev_ids: the Markov head's previous token of each slot.
    -> {"pre_norm" [K, D], "hidden" [K, D] (post norm), "logits" [K, V] (with the Markov bias), "conf" [K]}."""
    K, W, eps = hp["block_size"], hp["sliding_window"], hp["rms_norm_eps"]
    rd, theta, hc = hp["rope_head_dim"], hp["rope_theta"], 4
    p = feats_PF.shape[0]
    first, last = f"mtp.{hp['stages'][0]}.", f"mtp.{hp['stages'][-1]}."
    lo = max(0, p - W)
    main_x = [rms(w[first + "main_proj.weight"] @ feats_PF[t], eps, w[first + "main_norm.weight"])
              for t in range(lo, p)]
    ids = [anchor_id] + [hp["noise_token_id"]] * (K - 1)
    streams = [torch.stack([embed_VD[i]] * hc) for i in ids]  # per slot [hc, D]
    block_pos = [p + k for k in range(K)]
    for stage in hp["stages"]:
        pre = f"mtp.{stage}."
        a = pre + "attn."
        ctx_keys = [(t, rope(rms(w[a + "wkv.weight"] @ mx, eps, w[a + "kv_norm.weight"]), t, rd, theta))
                    for t, mx in zip(range(lo, p), main_x)]
        mixed = [hc_pre(s, w[pre + "hc_attn_fn"], w[pre + "hc_attn_scale"], w[pre + "hc_attn_base"], hp)
                 for s in streams]
        xs = torch.stack([rms(h, eps, w[pre + "attn_norm.weight"]) for h, _, _ in mixed])
        att = attention(xs, ctx_keys, block_pos, w, pre, hp, llamacpp_window)
        streams = [hc_post(att[k], streams[k], mixed[k][1], mixed[k][2]) for k in range(K)]
        new = []
        for s in streams:
            h, post, c = hc_pre(s, w[pre + "hc_ffn_fn"], w[pre + "hc_ffn_scale"], w[pre + "hc_ffn_base"], hp)
            new.append(hc_post(moe(rms(h, eps, w[pre + "ffn_norm.weight"]), w, pre, hp), s, post, c))
        streams = new
    pre_norm = []
    for s in streams:
        mixes = w[last + "hc_head_fn"] @ rms(s.reshape(-1), eps)
        weights = torch.sigmoid(mixes * w[last + "hc_head_scale"] + w[last + "hc_head_base"]) + hp["hc_eps"]
        pre_norm.append(sum(weights[i] * s[i] for i in range(hc)))
    pre_norm = torch.stack(pre_norm)
    hidden = rms(pre_norm, eps, w[last + "norm.weight"])
    w1, w2 = w[last + "markov_head.markov_w1.weight"], w[last + "markov_head.markov_w2.weight"]
    e = w1[torch.tensor(prev_ids)]  # [K, R]
    logits = hidden @ lm_head_VD.t() + e @ w2.t()
    conf = torch.cat([pre_norm, e], dim=-1) @ w[last + "confidence_head.proj.weight"][0]
    return {"pre_norm": pre_norm, "hidden": hidden, "logits": logits, "conf": conf}
