#!/usr/bin/python3
"""Real PyTorch files into shardopt and back: Debian's python3-torch trains a
small model (with BatchNorm buffers) a few steps with Adam, AdamW and SGD
momentum, saves the optimizer state_dict alone (plus the model's state_dict)
and the combined {"model", "optimizer"} layout; `shardctl import` reads each,
`shardctl consolidate --format=torch` exports the result, and the export must
hold bitwise the same parameters and state, and continue identically when
loaded into a fresh torch.optim optimizer.
   torch_import.py SHARDCTL WORKDIR"""
import copy
import os
import subprocess
import sys

import torch

shardctl, work = sys.argv[1], sys.argv[2]


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(),
                               torch.nn.Linear(8, 3))


def train(kind):
    m = model()
    if kind == "adam":
        opt = torch.optim.Adam(m.parameters(), lr=1e-2, betas=(0.8, 0.95), eps=1e-7, weight_decay=0.01)
    elif kind == "adamw":
        opt = torch.optim.AdamW(m.parameters(), lr=2e-3, weight_decay=0.05)
    else:
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, dampening=0.1, weight_decay=1e-3)
    for step in range(3):
        torch.manual_seed(100 + step)
        opt.zero_grad()
        m(torch.randn(16, 6)).pow(2).mean().backward()
        opt.step()
    return m, opt


def run(*args, ok=True):
    r = subprocess.run([shardctl, *args], capture_output=True, text=True, timeout=120)
    out = (r.stdout + r.stderr).strip()
    if ok and r.returncode != 0:
        sys.exit(f"FAIL: shardctl {' '.join(args)}: {out}")
    if not ok and r.returncode == 0:
        sys.exit(f"FAIL: shardctl {' '.join(args)} should have failed: {out}")
    if "Exception raised from" in out or "frame #" in out or len(out.splitlines()) > 3:
        sys.exit(f"FAIL: shardctl {' '.join(args)} printed more than a one-line error:\n{out}")
    return out


def check_roundtrip(kind, m, opt, exported):
    sd = torch.load(exported)
    names = sd["param_names"]
    params = dict(m.named_parameters())
    assert names == list(params), (names, list(params))
    for n in names:
        assert torch.equal(sd["params"][n], params[n].detach()), f"{kind}: parameter {n} differs"
    ours, theirs = sd["state"], opt.state_dict()["state"]
    for i, n in enumerate(names):
        for key, t in theirs[i].items():
            if key == "step":
                assert float(ours[i]["step"]) == float(t), (kind, n, ours[i]["step"], t)
            else:
                assert torch.equal(ours[i][key], t), f"{kind}: {key} of {n} differs"
    g_ours, g_theirs = sd["param_groups"][0], opt.state_dict()["param_groups"][0]
    for key in ("lr", "weight_decay", "betas", "eps", "momentum", "dampening", "nesterov"):
        if key in g_theirs:
            assert g_ours[key] == g_theirs[key] or tuple(g_ours[key]) == tuple(g_theirs[key]), (kind, key)
    # Continue: a fresh torch optimizer loaded from the export takes the same
    # next step as the original.
    m2 = model()
    with torch.no_grad():
        for n, p in m2.named_parameters():
            p.copy_(sd["params"][n])
    m2.load_state_dict({**m.state_dict(), **{n: sd["params"][n] for n in names}})
    opt2 = type(opt)(m2.parameters(), **{k: v for k, v in g_theirs.items() if k != "params"})
    opt2.load_state_dict({"state": sd["state"], "param_groups": [dict(g_theirs)]})
    # The original continues on copies, so that it stays as saved.
    m1 = copy.deepcopy(m)
    opt1 = type(opt)(m1.parameters(), **{k: v for k, v in g_theirs.items() if k != "params"})
    opt1.load_state_dict(copy.deepcopy(opt.state_dict()))
    for mm, oo in ((m1, opt1), (m2, opt2)):
        torch.manual_seed(7)
        oo.zero_grad()
        mm(torch.randn(16, 6)).pow(2).mean().backward()
        oo.step()
    for (n, a), (_, b) in zip(m1.named_parameters(), m2.named_parameters()):
        assert torch.equal(a, b), f"{kind}: next step differs at {n}"


for kind in ("adam", "adamw", "sgd"):
    m, opt = train(kind)
    d = os.path.join(work, kind)
    os.makedirs(d, exist_ok=True)
    torch.save(opt.state_dict(), f"{d}/opt.pt")
    torch.save(m.state_dict(), f"{d}/model.pt")
    torch.save({"model": m.state_dict(), "optimizer": opt.state_dict()}, f"{d}/combined.pt")
    for label, args in (("separate", [f"{d}/opt.pt", f"{d}/ck1", f"--params={d}/model.pt"]),
                        ("combined", [f"{d}/combined.pt", f"{d}/ck2"])):
        ck = args[1]
        print(run("import", *args, f"--optimizer={kind}"))
        run("consolidate", ck, f"{ck}/export.pt", "--format=torch")
        check_roundtrip(kind, m, opt, f"{ck}/export.pt")
        print(f"{kind} ({label}): imported, exported, bitwise equal, next step identical")

# Clear one-line refusals.
m, opt = train("adamw")
groups = torch.optim.AdamW([{"params": [p for n, p in m.named_parameters() if "bias" not in n]},
                            {"params": [p for n, p in m.named_parameters() if "bias" in n], "weight_decay": 0.0}])
torch.save({"model": m.state_dict(), "optimizer": groups.state_dict()}, f"{work}/groups.pt")
print(run("import", f"{work}/groups.pt", f"{work}/g", "--optimizer=adamw", ok=False))
torch.save(opt.state_dict(), f"{work}/lonely.pt")
print(run("import", f"{work}/lonely.pt", f"{work}/l", "--optimizer=adamw", ok=False))
torch.save(opt.state_dict(), f"{work}/legacy.pt", _use_new_zipfile_serialization=False)
print(run("import", f"{work}/legacy.pt", f"{work}/x", f"--params={work}/adam/model.pt", "--optimizer=adamw",
          ok=False))
print(run("import", f"{work}/adamw/combined.pt", f"{work}/y", "--optimizer=sgd", ok=False))
with open(f"{work}/garbage.pt", "wb") as f:
    f.write(b"PK\x03\x04" + os.urandom(2000))
print(run("import", f"{work}/garbage.pt", f"{work}/z", "--optimizer=adam", ok=False))
print("PASS")
