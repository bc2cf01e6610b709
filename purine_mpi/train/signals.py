"""Signals and the agreed stop (a loop service): after every iteration all
ranks agree on one stop code (runtime/stop.py: SIGTERM, SIGINT, SIGUSR1, a
closed stdout, a diverged rank; a parameter-server worker adds its
servers: ps_worker.py); on a stop the loop writes a checkpoint
(checkpoints.py) and this service says how to go on.
"""
from .loop import Service


class StopAgreement(Service):
    def on_stop_request(self, loop, done):
        st = loop.state
        st.stop_code = self.agree(loop, done, st.diverged)

    def agree(self, loop, done, diverged):
        """The stop code every rank agrees on after iteration ``done``."""
        return loop.state.stop.agree(loop.world, diverged)

    def on_stop(self, loop, done):
        st = loop.state
        if st.stop_code and st.early_stopped is None:
            loop.say(f"stopping at iter {done} on {st.stop.name}: checkpoint written; "
                     "continue with --resume auto")
