"""Writes torch.save files for tests/unit/torch_pickle_test.cc, each with what
torch.load reads back, flattened to one line per value (tensors as their raw
bytes, floats as their bits), in NAME.expect next to NAME.pt.

Usage: torch_pickle_files.py OUT_DIR   (Debian's python3-torch 1.13)
"""
import collections
import datetime
import os
import struct
import sys
import zipfile

import torch

DTYPES = {
    torch.float32: "float32", torch.float64: "float64", torch.float16: "float16",
    torch.bfloat16: "bfloat16", torch.int64: "int64", torch.int32: "int32",
    torch.int16: "int16", torch.int8: "int8", torch.uint8: "uint8", torch.bool: "bool",
}


def key(k):
    if isinstance(k, str):
        return "s:" + k
    if isinstance(k, int) and not isinstance(k, bool):
        return "i:%d" % k
    raise TypeError("key %r" % (k,))


def flat(v, path, out):
    if isinstance(v, torch.Tensor):
        t = v.detach().contiguous().reshape(-1)
        raw = t.to(torch.uint8) if t.dtype == torch.bool else t.view(torch.uint8)
        out.append("%s\ttensor\t%s\t%s\t%s" % (path, DTYPES[v.dtype], list(v.shape), raw.numpy().tobytes().hex()))
    elif isinstance(v, dict):
        out.append("%s\tdict\t%d" % (path, len(v)))
        for k, x in v.items():
            flat(x, path + "/" + key(k), out)
    elif isinstance(v, (list, tuple)):
        out.append("%s\t%s\t%d" % (path, "list" if isinstance(v, list) else "tuple", len(v)))
        for i, x in enumerate(v):
            flat(x, "%s/%d" % (path, i), out)
    elif v is None:
        out.append(path + "\tNone")
    elif isinstance(v, bool):
        out.append("%s\tbool\t%d" % (path, v))
    elif isinstance(v, int):
        out.append("%s\tint\t%d" % (path, v))
    elif isinstance(v, float):
        out.append("%s\tfloat\t%s" % (path, struct.pack("<d", v).hex()))
    elif isinstance(v, str):
        out.append("%s\tstr\t%s" % (path, v.encode().hex()))
    elif isinstance(v, (torch.dtype, torch.device)):  # the reader gives "torch.float32", "cuda:1"
        out.append("%s\tstr\t%s" % (path, str(v).encode().hex()))
    elif isinstance(v, bytes):
        out.append("%s\tbytes\t%s" % (path, v.hex()))
    else:
        raise TypeError("%s: %r" % (path, type(v)))


def save(out_dir, name, obj, **kwargs):
    path = os.path.join(out_dir, name + ".pt")
    torch.save(obj, path, **kwargs)
    return path


def save_checked(out_dir, name, obj):
    path = save(out_dir, name, obj)
    lines = []
    flat(torch.load(path), "", lines)
    with open(os.path.join(out_dir, name + ".expect"), "w") as f:
        f.write("\n".join(lines) + "\n")


def model():
    return torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


def train(m, opt, steps=2):
    for _ in range(steps):
        opt.zero_grad()
        m(torch.randn(6, 4)).pow(2).sum().backward()
        opt.step()


def main():
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    torch.manual_seed(0)

    m = model()
    adam = torch.optim.Adam(m.parameters(), lr=1e-3)
    train(m, adam)
    save_checked(out, "adam", adam.state_dict())
    save_checked(out, "model", m.state_dict())
    save_checked(out, "combined", {"model": m.state_dict(), "optimizer": adam.state_dict(), "epoch": 7})

    m2 = model()
    decay = [p for n, p in m2.named_parameters() if n.endswith("weight") and p.dim() > 1]
    no_decay = [p for n, p in m2.named_parameters() if not (n.endswith("weight") and p.dim() > 1)]
    adamw = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01},
                               {"params": no_decay, "weight_decay": 0.0}], lr=3e-3)
    train(m2, adamw)
    save_checked(out, "adamw", adamw.state_dict())

    m3 = model()
    sgd = torch.optim.SGD(m3.parameters(), lr=0.1, momentum=0.9)
    train(m3, sgd)
    save_checked(out, "sgd", sgd.state_dict())

    big = torch.arange(60, dtype=torch.float32).reshape(6, 10)
    save_checked(out, "view", big[1:4, 2:7])  # offset 12, stride (10, 1), alone in the file
    save_checked(out, "views", {
        "slice": big[1:4, 2:7], "t": big.t(), "whole": big, "again": big,
        "col": big[:, 3], "expand": torch.tensor([1.5, -2.0]).expand(3, 2),
        "scalar": torch.tensor(3.25), "empty": torch.zeros(0, 3),
    })
    save_checked(out, "dtypes", {
        "bf16": torch.randn(5, 3).to(torch.bfloat16), "fp16": torch.randn(4).half(),
        "i64": torch.tensor([-(2 ** 62), -1, 0, 2 ** 40 + 3]), "f64": torch.randn(3, dtype=torch.float64),
        "i32": torch.tensor([-7, 70000], dtype=torch.int32), "i16": torch.tensor([-300], dtype=torch.int16),
        "i8": torch.tensor([-128, 127], dtype=torch.int8), "u8": torch.tensor([0, 255], dtype=torch.uint8),
        "bool": torch.tensor([True, False, True]),
        "bf16_slice": torch.randn(4, 4).to(torch.bfloat16)[1:3, ::2],
    })
    save_checked(out, "scalars", {
        "ints": [0, 1, -1, 255, 256, 65535, 65536, -129, 2 ** 31 - 1, -2 ** 31, 2 ** 31, 2 ** 63 - 1, -2 ** 63],
        "floats": (0.0, -0.0, 1e-300, float("inf"), float("-inf"), 0.1),
        "str": "h\u00e9llo \u2713 \U0001F600", "bytes": b"\x00\xff\x80a", "empty_bytes": b"",
        "none": None, "bools": [True, False], "nested": ((1, (2, [3, {4: "x"}])),), "one": [5],
        "big_list": list(range(2500)), "od": collections.OrderedDict([("z", 1), ("a", 2)]),
        "dtype": torch.float32, "device": torch.device("cuda", 1),
    })
    save(out, "set", {"s": {1, 2}})
    save(out, "date", {"d": datetime.date(2020, 1, 2)})
    save(out, "legacy", {"w": torch.ones(2)}, _use_new_zipfile_serialization=False)
    # A stride-0 view: a 4-byte storage that reads as 20000 x 20000 (1.6 GB).
    save(out, "expand_huge", torch.zeros(1).expand(20000, 20000))
    small = torch.nn.Linear(2, 2)
    save_checked(out, "small", small.state_dict())
    # Re-zipped copies of small.pt: a version LibTorch 1.13 does not read,
    # records outside a folder, compressed records, a storage record flagged
    # as a directory (which miniz would "extract" as uninitialized memory).
    src = zipfile.ZipFile(os.path.join(out, "small.pt"))
    for name, rename, method in [("badversion", None, zipfile.ZIP_STORED),
                                 ("nofolder", lambda n: n.split("/", 1)[1], zipfile.ZIP_STORED),
                                 ("deflated", None, zipfile.ZIP_DEFLATED),
                                 ("dirflag", None, zipfile.ZIP_STORED)]:
        with zipfile.ZipFile(os.path.join(out, name + ".pt"), "w", method) as z:
            for info in src.infolist():
                data = src.read(info.filename)
                if name == "badversion" and info.filename.endswith("/version"):
                    data = b"999\n"
                target = zipfile.ZipInfo(rename(info.filename) if rename else info.filename)
                target.compress_type = method
                target.external_attr = 0o600 << 16
                if name == "dirflag" and info.filename.endswith("/data/0"):
                    target.external_attr |= 0x10
                z.writestr(target, data)


if __name__ == "__main__":
    main()
