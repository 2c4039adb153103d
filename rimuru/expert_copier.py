"""`ExpertCopier`: host -> pool copies of expert matrices, and the events that order them against compute.

On CUDA, copies run on a side stream from pinned host memory and return an event; `wait` makes the compute stream
wait for it, so a layer never reads a page whose copy has not landed. On CPU a copy is done when it returns and
events are None, so the same code paths run in the tests.

Every copy is timed for the cost model (`take_timings`): a pair of CUDA events around it on a GPU, its wall time
on CPU.
"""

import contextlib
import time

import torch


class ExpertCopier:
    def __init__(self, expert_view: torch.Tensor):
        self.expert_view = expert_view  # [P, F * D]
        # each page's row, made on its first copy and kept: a copy indexes no view (not `unbind`, which makes one
        # tensor a page up front: a tiny model on a whole H200 has 15 million pages, 24 s of start-up)
        self._pages: dict[int, torch.Tensor] = {}
        self.is_cuda = expert_view.device.type == "cuda"
        self.stream = torch.cuda.Stream(expert_view.device) if self.is_cuda else None
        self.bytes_copied = 0
        self._timed: list[tuple[int, object, object]] = []  # (bytes, start event, end event) not yet read
        self._done_bytes, self._done_seconds = 0, 0.0  # finished copies not yet taken

    def copy(self, page_ids: list[int], matrices, after=None, side_stream: bool = True):
        """Copy one expert's matrices into `page_ids`; returns the event that marks the copy done (None on CPU).

        `after`: an event the copy must wait for (the last reader of the destination pages). With
        `side_stream=False` the copy is queued on the compute stream (the miss path, which must finish anyway).
        """
        return self.copy_many([(page_ids, matrices)], after, side_stream)

    def copy_many(self, experts: list[tuple[list[int], tuple]], after=None, side_stream: bool = True):
        """`copy` of several experts (page ids, matrices), in order, as one timed batch: one stream switch, one wait
        and one pair of timing events in all (per expert they cost the host about as much as its three copies).
        Returns the event after the last copy; None on CPU or with nothing to copy."""
        if not experts:
            return None
        num_bytes = sum(m.numel() * m.element_size() for _, matrices in experts for m in matrices)
        self.bytes_copied += num_bytes
        if not self.is_cuda:
            start = time.perf_counter()
            for page_ids, matrices in experts:
                self._copy(page_ids, matrices)
            self._done_bytes += num_bytes
            self._done_seconds += time.perf_counter() - start
            return None
        stream = self.stream if side_stream else torch.cuda.current_stream()
        # NOTE: on the compute stream (the miss path) no stream switch: entering one costs host time a layer
        with torch.cuda.stream(stream) if side_stream else contextlib.nullcontext():
            if after is not None:
                stream.wait_event(after)
            begin = torch.cuda.Event(enable_timing=True)
            begin.record(stream)
            for page_ids, matrices in experts:
                self._copy(page_ids, matrices)
            done = torch.cuda.Event(enable_timing=True)
            done.record(stream)
        self._timed.append((num_bytes, begin, done))
        return done

    def take_timings(self) -> tuple[int, float]:
        """(bytes, seconds) of the copies finished since the last call; copies still in flight wait for the next."""
        pending = []
        for num_bytes, begin, done in self._timed:
            if done.query():
                self._done_bytes += num_bytes
                self._done_seconds += begin.elapsed_time(done) / 1e3
            else:
                pending.append((num_bytes, begin, done))
        self._timed = pending
        taken = (self._done_bytes, self._done_seconds)
        self._done_bytes, self._done_seconds = 0, 0.0
        return taken

    def _copy(self, page_ids: list[int], matrices) -> None:
        for page_id, matrix in zip(page_ids, matrices):  # `ExpertStore.host_rows` are rows already
            self._page(page_id).copy_(matrix if matrix.dim() == 1 else matrix.reshape(-1), non_blocking=True)

    def _page(self, page_id: int) -> torch.Tensor:
        page = self._pages.get(page_id)
        if page is None:
            page = self._pages[page_id] = self.expert_view[page_id]
        return page

    def wait(self, event) -> None:
        """Make the compute stream wait for a copy (no-op on CPU)."""
        if event is not None:
            torch.cuda.current_stream().wait_event(event)

    def compute_mark(self):
        """An event after everything queued on the compute stream so far (None on CPU)."""
        if not self.is_cuda:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream())
        return event
