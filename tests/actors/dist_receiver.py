"""A STAND-IN for main SGLang's weight-update receiver, for tests of sync="distributed" on CPU.

Main SGLang cannot start on these machines (its kernels need CUDA; ../shared/notes/sglang.md) and
sglang-jax has no update endpoints, so this process plays the server side of the protocol the way
SGLang's ModelRunner does it: /update_weights_from_disk loads a checkpoint by name (sync="disk");
/init_weights_update_group joins a torch.distributed group at rank
rank_offset (+ tp_rank 0) through the learner's TCP rendezvous store; /update_weights_from_distributed
allocates (names, dtypes, shapes), receives each tensor by a broadcast from rank 0 in that order,
and loads them by name, here into a real transformers LlamaForCausalLM. The transport, the names
and the layout are real; that main SGLang accepts them is checked only by benchmarks/gpu_sglang.sh
on a GPU with main SGLang (not run yet). benchmarks/gpu_check.sh runs this stand-in on a GPU.

    python tests/actors/dist_receiver.py --model-path DIR --port P   (or launched by the engine:
    launch_module="tests.actors.dist_receiver" with the repository on PYTHONPATH)

/stand_in/logits (test only) returns the model's logits so a test can compare them with Cadence's
JAX model; /get_server_info reports weight_version like SGLang does; /generate samples from the
model (input_ids, temperature, max_new_tokens, stop_token_ids; top_p 1 only) and answers in
SGLang's response format, so a whole `cadence train` run can use it.

--tp N plays a tensor-parallel server: N-1 more ranks (child processes, as SGLang's tp workers)
join at rank_offset + tp_rank and receive every tensor too (SGLang's weight loaders then keep their
shard; these keep a sum per tensor, which /stand_in/tp_checksums returns for each rank).

--device cuda --dtype bfloat16 plays a GPU server (nccl needs the tensors on the GPU). A model
directory with config.json and no weights starts from random weights (a benchmark then sends
every tensor; /stand_in/logits.npy shows whether they all arrived).
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import io
import json
import os
import subprocess
import sys
import threading

import numpy as np
import torch
import torch.distributed as dist
from aiohttp import web
from torch.distributed import distributed_c10d as c10d
from transformers import AutoConfig, AutoModelForCausalLM


def join_group(req: dict, tp_rank: int):
    """One rank's /init_weights_update_group: rendezvous at rank_offset + tp_rank, then the group."""
    timeout = datetime.timedelta(seconds=120)
    rank, world = int(req["rank_offset"]) + tp_rank, int(req["world_size"])
    store, rank, world = next(c10d.rendezvous(f"tcp://{req['master_address']}:{req['master_port']}",
                                              rank, world, timeout=timeout))
    store.set_timeout(timeout)
    store = c10d.PrefixStore(req["group_name"], store)
    pg, _ = c10d._new_process_group_helper(world, rank, [], c10d.Backend(req.get("backend", "nccl")), store,
                                           group_name=req["group_name"], timeout=timeout)
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world)}
    return pg


def receive(pg, req: dict, device: str = "cpu") -> list[tuple[str, torch.Tensor]]:
    """One rank's /update_weights_from_distributed: allocate as announced, receive in that order."""
    weights, works = [], []
    for name, dtype, shape in zip(req["names"], req["dtypes"], req["shapes"]):
        w = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
        works.append(dist.broadcast(w, src=0, group=pg, async_op=True))
        weights.append((name, w))
    for w in works:
        w.wait()
    return weights


def checksums(weights) -> dict[str, float]:
    return {name: float(w.double().sum()) for name, w in weights}


class TPWorker:
    """tp ranks 1..N-1 of a --tp N stand-in: a child process driven by JSON lines on stdin/stdout."""

    def __init__(self, tp_rank: int, device: str):
        self.proc = subprocess.Popen([sys.executable, __file__, "--tp-worker", str(tp_rank), "--device", device],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def send(self, op: str, req: dict) -> None:
        self.proc.stdin.write(json.dumps({"op": op, "req": req}) + "\n")
        self.proc.stdin.flush()

    def reply(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"tp worker exited ({self.proc.poll()})")
        out = json.loads(line)
        if "error" in out:
            raise RuntimeError(f"tp worker: {out['error']}")
        return out


def tp_worker_main(tp_rank: int, device: str) -> None:
    groups, sums = {}, {}
    for line in sys.stdin:
        cmd = json.loads(line)
        op, req = cmd["op"], cmd["req"]
        try:
            if op == "init":
                groups[req["group_name"]] = join_group(req, tp_rank)
            elif op == "update":
                sums.update(checksums(receive(groups[req["group_name"]], req, device)))
            elif op == "destroy":
                dist.destroy_process_group(groups.pop(req["group_name"]))
            print(json.dumps({"sums": sums}), flush=True)
        except Exception as e:  # noqa: BLE001 - reported to the main rank, which answers success: false
            print(json.dumps({"error": f"{type(e).__name__}: {e}"}), flush=True)


class Receiver:
    def __init__(self, model_dir: str, tp: int = 1, device: str = "cpu", dtype: str = "float32"):
        self.device, torch_dtype = device, getattr(torch, dtype)
        if any(f.endswith(".safetensors") for f in os.listdir(model_dir)):
            self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype).to(device).eval()
        else:  # config only: random weights, all replaced by the first update
            with torch.device(device):
                self.model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir),
                                                              dtype=torch_dtype).eval()
        self.tp = tp
        self.workers = [TPWorker(r, device) for r in range(1, tp)]
        self.groups: dict[str, object] = {}
        self.weight_version = "default"
        self.updates = 0
        self.sums: list[dict[str, float]] = [{} for _ in range(tp)]  # per tp rank, by tensor name
        self.lock = threading.Lock()  # weights change only between generations

    def _on_all_ranks(self, op: str, req: dict, own):
        """Every tp rank takes part in each collective, as SGLang's scheduler runs it on all tp workers."""
        for w in self.workers:
            w.send(op, req)
        try:
            return own()
        finally:
            replies = [w.reply() for w in self.workers]
            for r, reply in enumerate(replies, start=1):
                self.sums[r] = reply["sums"]

    def init_group(self, req: dict) -> None:
        self.groups[req["group_name"]] = self._on_all_ranks("init", req, lambda: join_group(req, 0))

    def update(self, req: dict) -> None:
        weights = self._on_all_ranks("update", req,
                                     lambda: receive(self.groups[req["group_name"]], req, self.device))
        if self.tp > 1:  # what the tp test compares across ranks (a full-size benchmark skips the pass)
            self.sums[0].update(checksums(weights))
        params = dict(self.model.named_parameters())
        with torch.no_grad(), self.lock:
            for name, w in weights:
                if name not in params:
                    raise KeyError(f"unknown parameter {name}")
                if tuple(params[name].shape) != tuple(w.shape):
                    raise ValueError(f"{name}: shape {tuple(w.shape)} != {tuple(params[name].shape)}")
                params[name].copy_(w)  # casts, as SGLang's weight loaders do
        if "weight_version" in req:
            self.weight_version = req["weight_version"]
        self.updates += 1

    def load_from_disk(self, req: dict) -> None:
        """/update_weights_from_disk (main SGLang): the checkpoint at model_path, loaded by name."""
        from safetensors.torch import load_file

        files = [f for f in os.listdir(req["model_path"]) if f.endswith(".safetensors")]
        if not files:
            raise FileNotFoundError(f"no .safetensors in {req['model_path']}")
        params = dict(self.model.named_parameters())
        with torch.no_grad(), self.lock:
            for f in files:
                for name, w in load_file(os.path.join(req["model_path"], f)).items():
                    if name in params:
                        params[name].copy_(w)  # a tied lm_head shares embed_tokens' storage
        if "weight_version" in req:
            self.weight_version = req["weight_version"]

    def generate(self, req: dict) -> dict:
        sp = req.get("sampling_params", {})
        if sp.get("top_p", 1.0) < 1.0:
            raise ValueError("the stand-in samples with top_p 1 only")
        temperature, stops = float(sp.get("temperature", 1.0)), set(sp.get("stop_token_ids") or [])
        x, past, out, finish = torch.tensor([req["input_ids"]], device=self.device), None, [], "length"
        with torch.no_grad(), self.lock:
            for _ in range(int(sp["max_new_tokens"])):
                o = self.model(input_ids=x, past_key_values=past, use_cache=True)
                past, logits = o.past_key_values, o.logits[0, -1].double()
                if temperature == 0:
                    tok = int(logits.argmax())
                    lp = float(torch.log_softmax(logits, -1)[tok])
                else:  # SGLang reports log_softmax(logits / T)
                    logp = torch.log_softmax(logits / temperature, -1)
                    tok = int(torch.multinomial(logp.exp(), 1))
                    lp = float(logp[tok])
                out.append((min(lp, 0.0), tok))
                x = torch.tensor([[tok]], device=self.device)
                if tok in stops:
                    finish = "stop"
                    break
        return {"output_ids": [t for _, t in out], "meta_info": {
            "output_token_logprobs": [[lp, t, None] for lp, t in out], "completion_tokens": len(out),
            "finish_reason": {"type": finish}, "weight_version": self.weight_version}}

    def destroy(self, req: dict) -> None:
        pg = self.groups.pop(req["group_name"])
        self._on_all_ranks("destroy", req, lambda: dist.destroy_process_group(pg))


def make_app(receiver: Receiver) -> web.Application:
    async def ok(_):
        return web.json_response({"success": True})

    async def server_info(_):
        return web.json_response({"tp_size": receiver.tp, "dp_size": 1, "pp_size": 1,
                                  "weight_version": receiver.weight_version, "updates": receiver.updates})

    def call(fn):
        async def handler(request):
            req = await request.json()
            try:
                await asyncio.to_thread(fn, req)
            except Exception as e:  # noqa: BLE001 - SGLang also answers failures with success: false
                return web.json_response({"success": False, "message": f"{type(e).__name__}: {e}"})
            return web.json_response({"success": True, "message": "ok"})
        return handler

    async def generate(request):
        return web.json_response(await asyncio.to_thread(receiver.generate, await request.json()))

    async def tp_checksums(_):
        return web.json_response({"ranks": receiver.sums})

    def forward(ids) -> torch.Tensor:
        with torch.no_grad(), receiver.lock:
            return receiver.model(input_ids=torch.tensor(ids, device=receiver.device)).logits.float().cpu()

    async def logits(request):
        out = await asyncio.to_thread(forward, (await request.json())["input_ids"])
        return web.json_response({"logits": out.tolist()})

    async def logits_npy(request):  # a 128k vocabulary is too much JSON
        out = await asyncio.to_thread(forward, (await request.json())["input_ids"])
        buf = io.BytesIO()
        np.save(buf, out.numpy(), allow_pickle=False)
        return web.Response(body=buf.getvalue(), content_type="application/octet-stream")

    app = web.Application(client_max_size=1 << 26)
    app.add_routes([web.get("/health", ok), web.get("/health_generate", ok), web.get("/get_server_info", server_info),
                    web.post("/init_weights_update_group", call(receiver.init_group)),
                    web.post("/update_weights_from_distributed", call(receiver.update)),
                    web.post("/update_weights_from_disk", call(receiver.load_from_disk)),
                    web.post("/destroy_weights_update_group", call(receiver.destroy)),
                    web.post("/pause_generation", ok), web.post("/continue_generation", ok),
                    web.post("/generate", generate), web.post("/abort_request", ok),
                    web.post("/stand_in/logits", logits), web.post("/stand_in/logits.npy", logits_npy),
                    web.get("/stand_in/tp_checksums", tp_checksums)])
    return app


def main() -> None:
    ap = argparse.ArgumentParser()  # the arguments Cadence launches a server with (ServerProcess.command)
    ap.add_argument("--tp-worker", type=int, help=argparse.SUPPRESS)  # internal: one child tp rank
    ap.add_argument("--model-path", "--model-dir", dest="model_path")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--device", default="cpu", help="where the model and received tensors live (cuda for nccl)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.tp_worker is not None:
        return tp_worker_main(args.tp_worker, args.device)
    if args.model_path is None or args.port is None:
        ap.error("--model-path and --port are required")
    receiver = Receiver(args.model_path, args.tp, args.device, args.dtype)
    web.run_app(make_app(receiver), host=args.host, port=args.port, print=None)


if __name__ == "__main__":
    main()
