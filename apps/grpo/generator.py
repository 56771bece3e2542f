"""`Generator`: one of `policy.replicas` actors of the asynchronous mode (docs/async_rl.md).

It decodes many requests at once, token by token, in a thread of its own, while the actor keeps
answering calls: `submit` (new requests), `push_weights` (a new policy version), `take_finished`
and the checkpoint calls. A request is one completion: (prompt sequence number `seq`, sample
`k`), generated with the policy version the driver fixed for it, by a `torch.Generator` seeded
from (seed, seq, k). Each token of a request is computed from that request alone (one forward
per request, never a batch mixing requests): its tokens are then a function of (weights, seed,
seq, k) only, whichever replica runs it, however the requests interleave, whenever a checkpoint
cuts in.

The snapshot (`state_dict`) takes the lock the decode thread holds for one token: it sees the
state between two tokens, with every in-flight request's partial tokens, log-probs and sampler
state. Nothing waits for a generation to finish. Weights go through `WeightVersions`: the
trainer's version is written as a reference (the step holds it in the trainer's shards), an
older version as tensors by replica 0 only and as a reference by the others.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from forge_ckpt import Checkpointable, WeightVersions

from .actors import shapes
from .model import build_model
from .seeding import derive_seed, seed_process
from .task import Vocab

OWNER = "generators[0]"  # the replica whose file holds the weight versions older than the trainer


def request_seed(seed: int, seq: int, k: int) -> int:
    """The sampling seed of completion `k` of the prompt at stream position `seq`."""
    return derive_seed(seed, f"async-sample-{seq}-{k}")


def replica_for(seq: int, replicas: int) -> int:
    """Which replica generates the prompt at stream position `seq` (all its samples)."""
    return seq % replicas


class Generator(Checkpointable):
    """See the module docstring. Requests are dicts of plain values (checkpointable as is)."""

    def __init__(
        self, seed: int, task_cfg: dict, model_cfg: dict, policy_cfg: dict, replica: int
    ) -> None:
        seed_process(seed, f"generator-{replica}")  # a distinct stream per replica index
        self.seed, self.replica = seed, replica
        self.vocab = Vocab(task_cfg["alphabet"])
        self.prompt_width, self.completion_width = shapes(task_cfg)
        self.model_cfg = model_cfg
        self.temperature = float(policy_cfg["temperature"])
        self.token_cost_s = float(policy_cfg.get("token_cost_ms", 0)) / 1000.0
        self.weights = WeightVersions()
        self.models: dict[int, torch.nn.Module] = {}
        self.latest = -1  # the newest version pushed: the trainer's at a save
        self.active: dict[tuple[int, int], dict[str, Any]] = {}
        self.samplers: dict[tuple[int, int], torch.Generator] = {}
        self.finished: list[dict[str, Any]] = []
        self.tokens = 0  # tokens decoded by this replica (progress; saved)
        self.tokens_since_load = 0  # not saved: what a resumed replica decoded (benchmarks)
        self.restored: list[tuple[int, int, int]] = []  # not saved: in_flight() as last loaded
        self.cond = threading.Condition()
        threading.Thread(target=self._decode_loop, daemon=True).start()

    # ---- driver calls ---------------------------------------------------------------------

    def submit(self, requests: list[dict[str, Any]]) -> int:
        with self.cond:
            for r in requests:
                key = (int(r["seq"]), int(r["k"]))
                self.active[key] = {**r, "out": [], "logprobs": []}
                gen = torch.Generator().manual_seed(request_seed(self.seed, *key))
                self.samplers[key] = gen
            self.cond.notify_all()
        return len(self.active)

    def push_weights(self, version: int, weights: dict[str, torch.Tensor], keep_from: int) -> int:
        with self.cond:
            self._install(int(version), weights)
            self.latest = max(self.latest, int(version))
            self.weights.keep_from(keep_from)
            self.models = {v: m for v, m in self.models.items() if v >= keep_from}
            self.cond.notify_all()
        return self.latest

    def missing_weights(self) -> dict[int, str]:
        return self.weights.missing()

    def held_weights(self, version: int) -> dict[str, torch.Tensor]:
        return dict(self.weights.get(version))

    def fill_weights(self, version: int, weights: dict, source: str, source_version: int) -> None:
        with self.cond:
            self.weights.fill(version, weights, source, source_version)
            self._install(version, weights)
            self.cond.notify_all()

    def take_finished(self) -> list[dict[str, Any]]:
        with self.cond:
            out, self.finished = self.finished, []
        return out

    def decoded(self, since_load: bool = False) -> int:
        """Tokens this replica has decoded (restored ones included), or since its last load."""
        with self.cond:
            return self.tokens_since_load if since_load else self.tokens

    def in_flight(self, restored: bool = False) -> list[tuple[int, int, int]]:
        """(seq, k, tokens so far) of every unfinished request; with `restored`, as the last
        load left them (the live list moves on as soon as the decode thread runs again)."""
        with self.cond:
            if restored:
                return list(self.restored)
            return sorted((s, k, len(r["out"])) for (s, k), r in self.active.items())

    # ---- decoding -------------------------------------------------------------------------

    def _install(self, version: int, weights: dict[str, torch.Tensor]) -> None:
        if not self.weights.has(version):
            self.weights.put(version, weights)
        if version not in self.models:
            p, c = self.prompt_width, self.completion_width
            model = build_model(self.model_cfg, self.vocab.size, p + c, self.seed)
            model.load_state_dict(weights)
            self.models[version] = model.eval()

    def _runnable(self) -> list[tuple[int, int]]:
        return sorted(k for k, r in self.active.items() if int(r["version"]) in self.models)

    def _decode_loop(self) -> None:
        """One token for every runnable request per round, each under the lock."""
        while True:
            with self.cond:
                keys = self._runnable()
                if not keys:
                    self.cond.wait()
                    continue
            for key in keys:
                if self.token_cost_s:
                    time.sleep(self.token_cost_s)  # models a larger policy's decode cost
                with self.cond:
                    if key in self.active:  # a load may have replaced the requests
                        self._one_token(key)

    @torch.no_grad()
    def _one_token(self, key: tuple[int, int]) -> None:
        req, gen = self.active[key], self.samplers[key]
        model = self.models[int(req["version"])]
        prompt = torch.tensor(np.asarray(req["prompt"], dtype=np.int64))  # a copy: writable
        valid = torch.tensor(np.asarray(req["prompt_valid"], dtype=np.bool_))
        out = torch.as_tensor(req["out"], dtype=torch.long)
        tokens = torch.cat([prompt, out])[None]
        mask = torch.cat([valid, torch.ones(len(out), dtype=torch.bool)])[None]
        logp = F.log_softmax(model(tokens, mask)[:, -1] / self.temperature, dim=-1)
        nxt = int(torch.multinomial(logp.exp(), 1, generator=gen).item())
        req["out"].append(nxt)
        req["logprobs"].append(float(logp[0, nxt]))
        self.tokens += 1
        self.tokens_since_load += 1
        if nxt == self.vocab.eos_id or len(req["out"]) == self.completion_width:
            del self.active[key], self.samplers[key]
            self.finished.append(self._episode(req))

    def _episode(self, req: dict[str, Any]) -> dict[str, Any]:
        c, n = self.completion_width, len(req["out"])
        completion = np.full(c, self.vocab.pad_id, dtype=np.int64)
        completion[:n] = req["out"]
        logprobs = np.zeros(c, dtype=np.float32)
        logprobs[:n] = req["logprobs"]
        text = self.vocab.decode([t for t in req["out"] if t != self.vocab.eos_id])
        keep = ("seq", "k", "step", "prompt_id", "prompt", "prompt_valid", "answer", "version")
        return {
            **{f: req[f] for f in keep},
            "completion": completion,
            "completion_mask": np.arange(c) < n,
            "logprobs": logprobs,
            "text": text,
        }

    # ---- Checkpointable -------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Between two tokens: the lock is the one the decode thread holds per token."""
        with self.cond:
            active = [
                {
                    **r,
                    "out": list(r["out"]),
                    "logprobs": list(r["logprobs"]),
                    "sampler": self.samplers[key].get_state(),
                }  # fmt: skip
                for key, r in sorted(self.active.items())
            ]
            return {
                "active": active,
                "finished": list(self.finished),
                "weights": self.weights.state_dict(self.latest, self.replica == 0, OWNER),
                "latest": self.latest,
                "tokens": self.tokens,
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with self.cond:
            self.active, self.samplers = {}, {}
            for r in state["active"]:
                key = (int(r["seq"]), int(r["k"]))
                gen = torch.Generator()
                gen.set_state(torch.tensor(np.asarray(r["sampler"]), dtype=torch.uint8))
                self.samplers[key] = gen
                req = {k: v for k, v in r.items() if k != "sampler"}
                self.active[key] = {**req, "out": list(r["out"]), "logprobs": list(r["logprobs"])}
            self.finished = [dict(f) for f in state["finished"]]
            self.weights.load_state_dict(state["weights"])
            self.models = {}
            for v in self.weights.versions():
                if self.weights.has(v):
                    self._install(v, self.weights.get(v))
            self.latest, self.tokens = int(state["latest"]), int(state["tokens"])
            self.tokens_since_load = 0
            self.restored = sorted((s, k, len(r["out"])) for (s, k), r in self.active.items())
            self.cond.notify_all()

    @staticmethod
    def reshard_states(states: list[dict[str, Any]], replicas: int) -> list[dict[str, Any]]:
        """N replicas -> M: every in-flight and finished request goes to replica
        `seq % M` (`replica_for`); the stored weight versions stay with replica 0 (the
        owner), the others hold references; token counts are summed into replica 0."""
        out = [
            {
                "active": [],
                "finished": [],
                "weights": {},
                "latest": states[0]["latest"],
                "tokens": 0,
            }  # fmt: skip
            for _ in range(replicas)
        ]
        for s in states:
            for r in s["active"]:
                out[replica_for(int(r["seq"]), replicas)]["active"].append(r)
            for f in s["finished"]:
                out[replica_for(int(f["seq"]), replicas)]["finished"].append(f)
        out[0]["tokens"] = sum(int(s["tokens"]) for s in states)
        for j, o in enumerate(out):
            o["active"].sort(key=lambda r: (int(r["seq"]), int(r["k"])))
            o["finished"].sort(key=lambda r: (int(r["seq"]), int(r["k"])))
            o["weights"] = dict(states[0]["weights"]) if j == 0 else _as_refs(states[0])
        return out


def _as_refs(state: dict[str, Any]) -> dict[str, Any]:
    """Replica 0's weight entries with its stored tensors turned into owner references."""
    w = WeightVersions
    return {
        v: e if w.is_ref(e) else w.owner_ref(int(v), OWNER) for v, e in state["weights"].items()
    }
