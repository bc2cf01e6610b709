"""Signals and the agreed stop (a loop service): after every iteration all
ranks agree on one stop code (runtime/stop.py: SIGTERM, SIGINT, SIGUSR1, a
closed stdout, a diverged rank), through the scheme (a parameter-server
worker adds its servers); on a stop the loop writes a checkpoint
(checkpoints.py) and this service says how to go on.

Layer: services (docs/DESIGN.md); may import the foundation, devices, data,
ops, graph, job, composition and dispatch layers below it, and its own.
"""
from .loop import Service


class StopAgreement(Service):
    def on_stop_request(self, loop, done):
        loop.stop_code = loop.scheme.agree_to_stop(loop, done, loop.diverged)

    def on_stop(self, loop, done):
        if loop.stop_code and loop.early_stopped is None:
            loop.say(f"stopping at iter {done} on {loop.stop.name}: checkpoint written; "
                     "continue with --resume auto")
