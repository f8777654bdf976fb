"""A request's images → embedding handles: pixels published once on the frontend's data plane, one
``EncodeJob`` per image (or video clip: its sampled frames) to the encoder the router picks, all in parallel.

A failed attempt — a server error, a timeout, the encoder gone — goes again to another listed encoder,
watched as the first was, up to ``ENCODE_ATTEMPTS`` failures of a live encoder (one found gone is left
out and costs no try); to the queue group only when none is listed (unwatched: a job NATS hands to a
process that died a moment ago gets no answer until the encode timeout, as one request of four did when
every encoder was killed at once). No encoder listed (one restarting, the tier scaling up from zero): the
request waits for one (``StackWorkers``), then it is a 503. The pixels stay
published until every image is encoded: an encode may be retried.
"""

from __future__ import annotations

import asyncio

from shared.bus.watched import call_watched
from services.frontend.errors import ApiError
from services.frontend.media import DecodedImage
from services.frontend.routing import ENCODER_KINDS, EncoderRouter
from services.frontend.workers import StackWorkers
from shared.bus.watched import Target, WorkerGone
from shared.bus.calls import ServiceCallError
from shared.bus.directory import Directory
from shared.bus.subjects import Subjects
from shared.dataplane.plane import DataPlane
from shared.logging import get_logger
from shared.messages import pack, unpack
from shared.messages.encode import EncodeJob, EncodeResult

log = get_logger(__name__)

ENCODE_ATTEMPTS = 3  # tries per image that fail with their encoder alive (a server error, a timeout)


class EncodeFanout:
    def __init__(self, nc, subjects: Subjects, plane: DataPlane, directory: Directory, workers: StackWorkers,
                 settings):
        self.nc = nc
        self.subjects = subjects
        self.plane = plane
        self.directory = directory
        self.workers = workers
        self.settings = settings
        self.router = EncoderRouter(nc, directory, subjects)
        self.encoded_images = 0
        self.pixel_bytes = 0  # decoded pixels published on this frontend's data plane, for encoders to pull

    def publish(self, images: list[DecodedImage], lease: float) -> list:
        """The images' (and clips' sampled frames') decoded pixels on the frontend's data plane, any number
        of pulls each until released."""
        handles = [self.plane.publish(i.pixels, consumers=None, lease=lease) for i in images]
        self.pixel_bytes += sum(h.nbytes for h in handles)
        return handles

    async def encode(self, request_id: str, images: list[DecodedImage]) -> list[EncodeResult]:
        if not images:
            return []
        until = self.workers.deadline()
        await self.workers.encoder(until)  # none listed: the queue group, and NATS says
        s = self.settings
        handles = self.publish(images, s.encode_timeout * ENCODE_ATTEMPTS + 30)
        try:
            jobs = [EncodeJob(request_id=request_id, image=h, content_hash=i.content_hash,
                              video=getattr(i, "sampling", None))  # a DecodedVideo's frames are sampled
                    for h, i in zip(handles, images)]
            targets = await self.router.targets([i.content_hash for i in images])
            results = await asyncio.gather(*(self._encode_one(job, t, until) for job, t in zip(jobs, targets)),
                                           return_exceptions=True)
            if failed := [r for r in results if isinstance(r, BaseException)]:
                # the request ends here: the images that were encoded will not be pulled, their encoders free them
                await self.plane.discard([r.embedding for r in results if isinstance(r, EncodeResult)])
                raise failed[0]
            return results
        finally:
            for handle in handles:
                self.plane.release(handle)

    async def _encode_one(self, job: EncodeJob, target: Target, until: float) -> EncodeResult:
        gone: set[str] = set()  # encoders found gone: never asked again
        tried: set[str] = set()  # encoders that failed it while alive: others first
        failures = 0  # attempts that failed with their encoder alive; one that finds it gone costs none (each
        # encoder is found gone once, and the wait for another ends at ``until``)
        while True:
            try:
                with self.router.outstanding.sending(target.instance):
                    reply = await call_watched(self.nc, self.directory, target, pack(job),
                                               self.settings.encode_timeout, "encoder")
                self.encoded_images += 1
                return unpack(EncodeResult, reply)
            except ServiceCallError as err:
                listed = True
                if err.no_responders or isinstance(err, WorkerGone):
                    # that encoder is gone; nobody in the queue group: every one listed is (the listing lags).
                    # Wait for another, or one restarted (a new instance); after one that went away, the
                    # queue group is asked anyway (an encoder may serve before it is listed)
                    gone |= {target.instance} if target.instance else {e.instance for e in
                                                                       self.directory.of(*ENCODER_KINDS)}
                    listed = await self.workers.encoder(until, exclude=gone) or bool(target.instance)
                else:
                    failures += 1
                    tried |= {target.instance} - {""}
                retry = err.status >= 500 and failures < ENCODE_ATTEMPTS and listed
                log.warning("encode.failed", request_id=job.request_id, status=err.status, retry=retry)
                if not retry:
                    raise ApiError(err.status, "image encoding failed: " + err.message) from None
                target = self.router.retarget(gone | tried)
                if not target.instance:  # every live listed one failed it once: again, the least loaded
                    target = self.router.retarget(gone)
