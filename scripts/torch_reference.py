#!/usr/bin/env python3
"""PyTorch on the same machine, for comparison with `bench conv|fc|resnet50`.

Prints one JSON line per measurement, shaped like the bench's lines:

    python3 scripts/torch_reference.py conv [--dtype f32|bf16] [--threads T] [--batch N]
    python3 scripts/torch_reference.py fc [--threads T]
    python3 scripts/torch_reference.py lstm [--dtype f32|bf16] [--threads T]
    python3 scripts/torch_reference.py resnet50 [--dtype f32|bf16] [--threads T] [--batch N]

`conv`: forward, backward-data and backward-weights of the `bench conv` layers
(ResNet-50's) at minibatch 16, channels-last tensors (PyTorch runs them on
oneDNN), each pass alone through `aten::convolution_backward`; bf16 reads bf16
tensors. `fc`: the `bench fc` shapes as `torch.mm` (PyTorch's BLAS: MKL in the
PyPI wheels). `lstm`: `nn.LSTM` over the `bench lstm` shapes, forward and
forward + backward (dX, dW, dR, db) less the forward, FLOPs counted as the
bench counts them; bf16 under `torch.autocast`. `resnet50`: ResNet-50 v1.5 (stride in the 3x3 convolutions), a
training step of softmax cross-entropy and SGD with momentum on synthetic
224x224 input, and inference; bf16 under `torch.autocast`. Medians of
repeated calls after warm-up calls.

PyTorch allocates every output anew; above 32 MiB glibc's malloc maps fresh
pages each time, and the page faults then count in the pass (x0.4 on the
largest layers). For kernel figures run it with jemalloc keeping its pages:

    apt-get install libjemalloc2; pip install torch
    MALLOC_CONF=dirty_decay_ms:-1,muzzy_decay_ms:-1 \\
      LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2 \\
      python3 scripts/torch_reference.py conv

The machines here change speed between processes: alternate this with the
bench (bench, this, bench, this) and compare medians.
"""

import argparse
import contextlib
import json
import os
import time

import torch
import torch.nn as nn

# name: (C, K, H = W, R = S, stride), as in examples/support/conv_bench.rs
CONV_LAYERS = {
    "res2_3x3": (64, 64, 56, 3, 1),
    "res2_1x1_up": (64, 256, 56, 1, 1),
    "res2_1x1_down": (256, 64, 56, 1, 1),
    "res3_3x3": (128, 128, 28, 3, 1),
    "res4_3x3": (256, 256, 14, 3, 1),
    "res5_3x3": (512, 512, 7, 3, 1),
    "res3_3x3_s2": (128, 128, 56, 3, 2),
    "res3_1x1_proj": (256, 512, 56, 1, 2),
    "conv1_7x7": (3, 64, 224, 7, 2),
}

# (N, C, K), as in examples/support/fc_bench.rs
FC_SHAPES = [
    (256, 1024, 1024),
    (512, 2048, 2048),
    (64, 4096, 4096),
    (16, 1024, 1024),
    (32, 1024, 1024),
    (16, 4096, 4096),
    (32, 4096, 4096),
]


def median_secs(f, reps, warm=2):
    for _ in range(warm):
        f()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t)
    ts.sort()
    return ts[len(ts) // 2]


def common():
    return {
        "threads": torch.get_num_threads(),
        "torch": torch.__version__.split("+")[0],
        "allocator": "jemalloc" if "jemalloc" in os.environ.get("LD_PRELOAD", "") else "default",
    }


def conv(args):
    dt = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    cl = torch.channels_last
    n = args.batch
    for name, (c, k, hw, r, s) in CONV_LAYERS.items():
        pad = r // 2
        x = torch.randn(n, c, hw, hw).to(dtype=dt, memory_format=cl)
        w = torch.randn(k, c, r, r).to(dtype=dt, memory_format=cl)
        y = torch.nn.functional.conv2d(x, w, stride=s, padding=pad)
        dy = torch.randn_like(y).to(memory_format=cl)
        flops = 2.0 * n * k * c * r * r * y.shape[2] * y.shape[3]

        def back(mask):
            return lambda: torch.ops.aten.convolution_backward(
                dy, x, w, None, [s, s], [pad, pad], [1, 1], False, [0, 0], 1, mask
            )

        passes = [
            ("fwd", lambda: torch.nn.functional.conv2d(x, w, stride=s, padding=pad)),
            ("bwd", back([True, False, False])),
            ("upd", back([False, True, False])),
        ]
        with torch.no_grad():
            for p, f in passes:
                secs = median_secs(f, args.reps)
                line = {"bench": "torch_conv", "pass": p, "dtype": args.dtype, "layer": name,
                        "n": n, "c": c, "k": k, "h": hw, "w": hw, "r": r, "s": r, "stride": s,
                        "gflops": round(flops / secs / 1e9, 1)}
                line.update(common())
                print(json.dumps(line), flush=True)


def fc(args):
    for n, c, k in FC_SHAPES:
        x, w, dy = torch.randn(n, c), torch.randn(k, c), torch.randn(n, k)
        y, dx, dw = torch.empty(n, k), torch.empty(n, c), torch.empty(k, c)
        flops = 2.0 * n * c * k
        passes = [
            ("fwd", lambda: torch.mm(x, w.t(), out=y)),
            ("bwd", lambda: torch.mm(dy, w, out=dx)),
            ("upd", lambda: torch.mm(dy.t(), x, out=dw)),
        ]
        with torch.no_grad():
            for p, f in passes:
                secs = median_secs(f, 3 * args.reps, warm=3)
                line = {"bench": "torch_fc", "pass": p, "n": n, "c": c, "k": k,
                        "gflops": round(flops / secs / 1e9, 1)}
                line.update(common())
                print(json.dumps(line), flush=True)


# (T, N, C, K), as in examples/bench.rs
LSTM_SHAPES = [(50, 64, 512, 512), (25, 64, 1024, 1024), (50, 16, 256, 256)]


def lstm(args):
    ctx = autocast(args)
    for t, n, c, k in LSTM_SHAPES:
        torch.manual_seed(0)
        cell = nn.LSTM(c, k)
        x = torch.randn(t, n, c, requires_grad=True)
        flops = 2.0 * t * n * 4 * k * (c + k)

        def fwd():
            with torch.no_grad(), ctx():
                cell(x)

        def train():
            with ctx():
                y, _ = cell(x)
            y.float().sum().backward()

        f = median_secs(fwd, args.reps)
        both = median_secs(train, args.reps)
        for p, secs, fl in [("fwd", f, flops), ("bwd_upd", max(both - f, 1e-9), 2 * flops)]:
            line = {"bench": "torch_lstm", "pass": p, "dtype": args.dtype, "t": t, "n": n,
                    "c": c, "k": k, "gflops": round(fl / secs / 1e9, 1)}
            line.update(common())
            print(json.dumps(line), flush=True)


def autocast(args):
    """A context running its block in bf16 under `--dtype bf16`."""
    if args.dtype == "bf16":
        return lambda: torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext


class Bottleneck(nn.Module):
    def __init__(self, cin, mid, stride):
        super().__init__()
        cout = 4 * mid
        self.c1, self.b1 = nn.Conv2d(cin, mid, 1, bias=False), nn.BatchNorm2d(mid)
        self.c2, self.b2 = nn.Conv2d(mid, mid, 3, stride, 1, bias=False), nn.BatchNorm2d(mid)
        self.c3, self.b3 = nn.Conv2d(mid, cout, 1, bias=False), nn.BatchNorm2d(cout)
        self.proj = None
        if stride != 1 or cin != cout:
            self.proj = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                      nn.BatchNorm2d(cout))

    def forward(self, x):
        y = torch.relu(self.b1(self.c1(x)))
        y = torch.relu(self.b2(self.c2(y)))
        y = self.b3(self.c3(y))
        return torch.relu(y + (x if self.proj is None else self.proj(x)))


def resnet50_model():
    layers = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
              nn.MaxPool2d(3, 2, 1)]
    cin = 64
    for mid, blocks, stride in [(64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)]:
        for i in range(blocks):
            layers.append(Bottleneck(cin, mid, stride if i == 0 else 1))
            cin = 4 * mid
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2048, 1000)]
    return nn.Sequential(*layers)


def resnet50(args):
    torch.manual_seed(0)
    batch = args.batch
    m = resnet50_model().to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(m.parameters(), lr=1e-3, momentum=0.9)
    x = torch.randn(batch, 3, 224, 224).to(memory_format=torch.channels_last)
    labels = torch.tensor([(i * 37) % 1000 for i in range(batch)])
    ctx = autocast(args)

    def step():
        opt.zero_grad(set_to_none=False)
        with ctx():
            loss = nn.functional.cross_entropy(m(x), labels)
        loss.backward()
        opt.step()

    def infer():
        with torch.no_grad(), ctx():
            m(x)

    m.train()
    train = median_secs(step, args.reps)
    m.eval()
    inf = median_secs(infer, args.reps)
    line = {"bench": "torch_resnet50", "dtype": args.dtype, "batch": batch,
            "train_images_per_s": round(batch / train, 2),
            "infer_images_per_s": round(batch / inf, 2)}
    line.update(common())
    print(json.dumps(line), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=["conv", "fc", "lstm", "resnet50"])
    ap.add_argument("--dtype", choices=["f32", "bf16"], default="f32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    if args.what == "fc" and args.dtype != "f32":
        ap.error("fc compares the f32 passes only (torch.mm)")
    torch.set_num_threads(args.threads)
    {"conv": conv, "fc": fc, "lstm": lstm, "resnet50": resnet50}[args.what](args)


if __name__ == "__main__":
    main()
