"""Ad hoc probe (stop 58): a block drafter whose mask rows also read [anchor embedding, fused
features of the position before it] through one [H, 2H] linear, against the shipped shape, each
trained the same minutes on the cached data; prints the best validation tau and the last
model's validation accuracy at block position 1.

    python benchmarks/probes/dspark_direct.py direct 4; python benchmarks/probes/dspark_direct.py base 4

It patches `DSparkTrain.forward` with its own copy (the variant measured); the same path is now
in the tree as `DSparkConfig.direct` (`train-head --direct`)."""
import sys, torch
import torch.nn.functional as F
from hal.models.dspark import DSparkConfig
from hal.training import block_train as bt, block_data

class Direct(bt.DSparkTrain):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        g = torch.Generator().manual_seed(99)
        H = self.cfg.hidden
        self.p["direct"] = torch.nn.Parameter(torch.randn(H, 2 * H, generator=g) * 0.02)

    def forward(self, feats, ids, anchors):
        c = self.cfg
        S, T = ids.shape
        N, B, D = anchors.shape[1], c.block, c.head_dim
        nq, nk = c.heads * D, c.kv_heads * D
        ctx = F.rms_norm(feats @ self.w("fc").T, (c.hidden,), self.w("hidden_norm"), c.eps)
        first = self.embed[ids.gather(1, anchors)]
        prev = ctx.gather(1, (anchors - 1).clamp(min=0)[..., None].expand(-1, -1, c.hidden))
        extra = torch.cat([first, prev], -1) @ self.p["direct"].T
        masks = self.w("mask").expand(S, N, B - 1, c.hidden) + extra[:, :, None]
        h = torch.cat([first[:, :, None], masks], 2).reshape(S, N * B, -1)
        pos_blk = (anchors[:, :, None] + torch.arange(B)).reshape(S, N * B)
        rot_blk = self.rope(pos_blk.reshape(-1))
        rot_ctx = self.rope(torch.arange(T).repeat(S))
        block_of = torch.arange(N).repeat_interleave(B)
        see_ctx = torch.arange(T)[None, None] < anchors.repeat_interleave(B, 1)[:, :, None]
        see_blk = (block_of[:, None] == block_of[None]).expand(S, N * B, N * B)
        mask = torch.cat([see_ctx, see_blk], 2)[:, None]
        for i in range(c.layers):
            x = F.rms_norm(h, (c.hidden,), self.w(f"{i}.attn_norm"), c.eps)
            qkv = x @ self.w(f"{i}.wqkv").T
            kv = ctx @ self.w(f"{i}.wqkv")[nq:].T
            rope = lambda t, rot, n: self.rope.apply(t.reshape(-1, n, D), rot).view(S, -1, n, D)
            q = rope(qkv[..., :nq], rot_blk, c.heads)
            k = torch.cat([rope(kv[..., :nk], rot_ctx, c.kv_heads), rope(qkv[..., nq:nq + nk], rot_blk, c.kv_heads)], 1)
            v = torch.cat([kv[..., nk:], qkv[..., nq + nk:]], 1).view(S, -1, c.kv_heads, D)
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               attn_mask=mask, enable_gqa=True)
            h = h + o.transpose(1, 2).reshape(S, N * B, nq) @ self.w(f"{i}.wo").T
            gate, up = (F.rms_norm(h, (c.hidden,), self.w(f"{i}.ffn_norm"), c.eps) @ self.w(f"{i}.wgu").T).split(c.ffn, -1)
            h = h + (F.silu(gate) * up) @ self.w(f"{i}.wdown").T
        out = F.rms_norm(h.view(S, N, B, -1)[:, :, 1:], (c.hidden,), self.w("norm"), c.eps)
        return out @ self.head.T, out

def pos1(model, d, to_draft, batch=8, anchors=16):
    """validation accuracy at block position 1 only."""
    g = torch.Generator().manual_seed(1234)
    hit = n = 0
    with torch.no_grad():
        for b0 in range(0, len(d.val), batch):
            f, ids, starts, lens, _ = d.batch(d.val[b0:b0 + batch])
            a = bt.sample_anchors(starts, lens, anchors, g)
            base, h = model(f, ids, a)
            prev, label, valid = bt.block_targets(ids, a, lens, model.cfg.block, to_draft)
            rows = base + model.markov(prev)
            ok = (rows.argmax(-1) == label) & valid & (label >= 0)
            hit += int(ok[..., 0].sum()); n += int(valid[..., 0].sum())
    return hit / n

if __name__ == "__main__":
    direct = sys.argv[1] == "direct"
    minutes = float(sys.argv[2])
    torch.set_num_threads(2)
    blob = block_data.responses("smollm2-135m")
    feats = block_data.tapped("smollm2-135m", blob)
    target, _ = block_data.load_target("smollm2-135m", None, None)
    c = target.cfg
    cfg = DSparkConfig(hidden=c.hidden, heads=c.heads, kv_heads=c.kv_heads, head_dim=c.head_dim, ffn=c.ffn,
                      layers=1, taps=(1, 16, 29), block=8, rank=32, draft_vocab=8192, eps=c.eps)
    if direct:
        bt.DSparkTrain = Direct
    box = {}
    orig = bt.validate
    def val(model, d, to_draft, batch, anchors):
        box["m"], box["d"], box["t"] = model, d, to_draft
        return orig(model, d, to_draft, batch, anchors)
    bt.validate = val
    got = bt.train_block(cfg, blob, feats, target, minutes, say=lambda l: print(sys.argv[1], l, flush=True))
    print(sys.argv[1], "steps", got["summary"]["steps"], "val", got["summary"]["val"],
          "pos1 (last model)", pos1(box["m"], box["d"], box["t"]), flush=True)
