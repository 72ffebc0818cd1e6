"""envd's process events, as both halves of ``process.Process`` (commands, PTYs) send them."""

from __future__ import annotations

import signal as signals

from protobuf import Oneof

from e2b.envd.process import process_pb as pb


def event(value: pb.ProcessEvent.StartEvent | pb.ProcessEvent.DataEvent | pb.ProcessEvent.EndEvent) -> pb.ProcessEvent:
    fields = {pb.ProcessEvent.StartEvent: "start", pb.ProcessEvent.DataEvent: "data", pb.ProcessEvent.EndEvent: "end"}
    return pb.ProcessEvent(event=Oneof(fields[type(value)], value))


def end(exit_code: int) -> pb.ProcessEvent.EndEvent:
    if exit_code > 128:  # the supervisor's 128 + N for a kill by signal N
        try:
            name = signals.Signals(exit_code - 128).name.removeprefix("SIG").lower()
        except ValueError:
            name = str(exit_code - 128)
        return pb.ProcessEvent.EndEvent(exit_code=exit_code, exited=False, status=f"signal: {name}")
    return pb.ProcessEvent.EndEvent(exit_code=exit_code, exited=True, status=f"exit status {exit_code}")
