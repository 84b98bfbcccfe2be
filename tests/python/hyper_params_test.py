"""The Python paths of the one hyper-parameter rule, with the shared table
(tests/fixtures/hyper_parameters.tsv): the ShardedOptimizer constructor and a
param_groups edit pushed at step() (what an LR scheduler does). One rank, no
launcher. Prints one line per row; exits 1 if any row disagrees."""
import sys

import torch

import shardopt

TABLE = sys.argv[1]

ADAM_ARG = {"lr": "lr", "eps": "eps", "weight_decay": "weight_decay"}
SGD_ARG = {"momentum": "momentum", "dampening": "dampening"}


def rows():
    with open(TABLE) as f:
        for line in f:
            line = line.rstrip("\n")
            if not line or line.startswith("#"):
                continue
            name, text, ok, _change = line.split("\t")
            yield name, text, float(text), ok == "ok"


def model():
    torch.manual_seed(0)
    return torch.nn.Linear(4, 2)


def construct(name, value):
    m = model()
    params = list(m.named_parameters())
    if name in ADAM_ARG:
        kw = {ADAM_ARG[name]: value}
        return shardopt.ShardedOptimizer(params, optimizer="adamw", **kw), m
    if name.startswith("betas"):
        betas = [0.9, 0.999]
        betas[int(name[6])] = value
        return shardopt.ShardedOptimizer(params, optimizer="adam", betas=tuple(betas)), m
    if name in SGD_ARG:
        return shardopt.ShardedOptimizer(params, optimizer="sgd", lr=0.1,
                                         **{SGD_ARG[name]: value}), m
    if name == "max_grad_norm":
        return shardopt.ShardedOptimizer(params, optimizer="adam", max_grad_norm=value), m
    raise ValueError(name)


GROUP_KEY = {"lr": ("lr", None), "eps": ("eps", None), "weight_decay": ("weight_decay", None),
             "betas[0]": ("betas", 0), "betas[1]": ("betas", 1)}


def edit_then_step(name, value):
    """Builds a valid AdamW, edits param_groups as a scheduler would, steps."""
    m = model()
    opt = shardopt.ShardedOptimizer(list(m.named_parameters()), optimizer="adamw", lr=1e-3)
    key, index = GROUP_KEY[name]
    if index is None:
        opt.param_groups[0][key] = value
    else:
        b = list(opt.param_groups[0][key])
        b[index] = value
        opt.param_groups[0][key] = tuple(b)
    before = [p.detach().clone() for p in m.parameters()]
    m(torch.ones(3, 4)).sum().backward()
    try:
        opt.step()
    except ValueError as e:
        # Refused before any update: the parameters are unchanged.
        assert all(torch.equal(a, p) for a, p in zip(before, m.parameters())), "updated anyway"
        return False, str(e)
    return True, ""


def main():
    bad = 0
    n = 0
    for name, text, value, ok in rows():
        n += 1
        try:
            construct(name, value)
            got, why = True, ""
        except ValueError as e:
            got, why = False, str(e)
        status = "PASS" if got == ok else "FAIL"
        bad += got != ok
        print(f"{status} constructor {name}={text}: {'accepted' if got else 'refused: ' + why}")
        if name in GROUP_KEY:
            got, why = edit_then_step(name, value)
            status = "PASS" if got == ok else "FAIL"
            bad += got != ok
            print(f"{status} param_groups {name}={text}: "
                  f"{'accepted' if got else 'refused: ' + why}")
    if n < 40:
        print(f"FAIL only {n} rows in {TABLE}")
        bad += 1
    print(f"python hyper-parameter paths: {'ok' if bad == 0 else f'{bad} wrong'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
