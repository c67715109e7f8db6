"""Settings, results and counters of the transfer engine."""

from __future__ import annotations

from dataclasses import dataclass

from .. import rules
from ..errors import ConfigError
from ..units import GiB


@dataclass(frozen=True)
class TransferConfig:
    """How many transfers run at once, how fast, and how hard to retry.

    A *transfer* is one file upload, one file download or one byte-range read.
    ``max_concurrency`` transfers run at most at once; the engine lowers that limit
    when the store throttles (halves it, at most once a second, never below
    ``min_concurrency``) and raises it again by one after every 8 transfers that
    finish without a throttle signal (AIMD). ``max_bytes_in_flight`` bounds the sum
    of the sizes of running transfers (uploads: the file size; reads: ``end - start``
    when both are given; downloads and open-ended reads count 0 because their size
    is not known up front). A single transfer larger than the bound still runs, alone.

    Memory bound. Uploaded and downloaded files stay on disk; what is held in
    memory at the same time is at most::

        M = min(max_bytes_in_flight, sum of in-flight read_all/submit_read ranges)   # range reads return bytes
          + (S3) uploads by file name (submit_upload with a known crc32c: checkpoint
                shard files): none, s3transfer reads each part from disk while sending it
          + (S3) uploads of a file object: s3transfer part buffers,
                (max_in_memory_upload_chunks + max_submission_concurrency) * part_size
                = (max(2, min(max_pool_connections // 2, 256 MiB // part_size)) + 5) * part_size
          + (S3) s3transfer download I/O queue: max_io_queue_size * io_chunksize = 16 * 256 KiB
          + (GCS) one chunk per running upload: multipart_threshold for objects up to it,
                else part_size
          + streams (submit_stream, what loads read through): what their jobs hold (the DCP
                reader bounds it by its in-flight budget), plus, on stores without a
                streamed GET (GCS, the default open_range), up to two part_size chunks per
                stream (the one being read, and the previous one while items cut from it wait)

    With the default :class:`~cloudckpt.storage.StorageOptions` (S3 ``part_size``
    64 MiB, ``max_pool_connections`` 64) the S3 file-object term is
    (4 + 5) * 64 MiB = 576 MiB, shared by every engine of a process (the store, and
    so its s3transfer manager, is shared). The local backend copies in 8 MiB
    chunks: 8 MiB per running transfer.

    Fields:
      max_concurrency: transfers in flight at most; the AIMD ceiling (>= 1).
      min_concurrency: the AIMD floor (1 <= min <= max).
      max_bytes_in_flight: bytes of transfers in flight (>= 1).
      bandwidth_limit: bytes/s across the whole engine, or None for no cap.
      stall_timeout: seconds without progress before an attempt fails with
        TransferStalled; 0 disables the watchdog.
      max_attempts: engine-level attempts per transfer on Transient errors
        (Throttled, Timeout, TransferStalled, 5xx, resets), on top of the SDK's own
        retries; a transfer that moved no new bytes for ``operation_timeout``
        (StorageOptions) is not re-attempted, whatever is left of them.
      backoff_base, backoff_max: exponential backoff with full jitter:
        sleep uniform(0, min(backoff_max, backoff_base * 2**(attempt-1))).
      checksum: compute CRC32C of every uploaded/downloaded file.
      request_rate: the job-wide request budget per prefix, requests/s, for writes and
        for reads alike (``pacing.py``): the engine of each rank sends at most
        ``request_rate / world_size`` requests per second. None: the store's own
        default (``ObjectStore.default_request_rates``: S3 3,500 writes and 5,500 reads
        per second, GCS 1,000 and 5,000, local folders none); 0: no pacing.
      start_jitter: while pacing, the first request after an idle spell waits a random
        fraction of this many seconds, so ranks that start together spread out. None:
        one pacing interval of the rank (``world_size / rate``); 0: none.

    Raises ConfigError naming the field, the value and what is allowed.
    """

    max_concurrency: int = 8
    min_concurrency: int = 1
    max_bytes_in_flight: int = 2 * GiB
    bandwidth_limit: float | None = None
    stall_timeout: float = 120.0
    max_attempts: int = 4
    backoff_base: float = 0.25
    backoff_max: float = 20.0
    checksum: bool = True
    request_rate: float | None = None
    start_jitter: float | None = None

    def __post_init__(self) -> None:
        rules.check("transfer option ", self, RULES)
        if self.min_concurrency > self.max_concurrency:
            raise ConfigError(f"transfer option min_concurrency={self.min_concurrency!r} is not allowed: use at most "
                              f"max_concurrency ({self.max_concurrency})")
        if self.backoff_max < self.backoff_base:
            raise ConfigError(f"transfer option backoff_max={self.backoff_max!r} is not allowed: use at least "
                              f"backoff_base ({self.backoff_base})")


#: The rule of every TransferConfig field (cloudckpt.rules), checked when one is made.
RULES: dict[str, rules.Rule] = {
    "max_concurrency": rules.integer(1),
    "min_concurrency": rules.integer(1),
    "max_bytes_in_flight": rules.integer(1),
    "bandwidth_limit": rules.number(0, strict=True, unit="bytes per second", none="for no cap"),
    "stall_timeout": rules.number(0, finite=False, why=" (0 disables the stall watchdog)"),
    "max_attempts": rules.integer(1),
    "backoff_base": rules.number(0),
    "backoff_max": rules.number(0),
    "checksum": rules.boolean(),
    "request_rate": rules.number(0, unit="requests per second for the whole job",
                                 why=" (0: no pacing)", none="for the store's default"),
    "start_jitter": rules.number(0, none="for one pacing interval"),
}


@dataclass(frozen=True)
class TransferResult:
    """One finished transfer. ``crc32c``: 8 lowercase hex digits of the CRC32C of
    the file's bytes (None when checksums are off). ``attempts``: engine-level
    attempts it took (1 when the first one succeeded). ``seconds``: from the first
    attempt's start to the end (queueing time excluded). ``version``: the object's
    version token as written (``ObjectStore.version``: S3 ETag, GCS generation), for an
    upload asked to record it and for a copy; None otherwise or where the store has none."""

    url: str
    local_path: str | None
    size: int
    crc32c: str | None
    attempts: int
    seconds: float
    version: str | None = None


@dataclass
class TransferStats:
    """A snapshot of the engine's counters.

    transfers: transfers that finished successfully; bytes_uploaded /
    bytes_downloaded: their sizes (reads count as downloaded); bytes_copied: the
    sizes of server-side copies (no byte of them crossed this process's link); retries: engine-level
    re-attempts; sdk_retries: requests the SDK retried (reported by the stores);
    throttled: throttle signals seen (SDK retries on 503/429 and Throttled errors);
    stalls: attempts failed by the stall watchdog; concurrency: the current limit;
    min_concurrency_seen: the lowest limit so far; paced_requests: requests counted
    against the pacing budget; paced_seconds: time attempts waited for it (start
    jitter included)."""

    transfers: int = 0
    bytes_uploaded: int = 0
    bytes_downloaded: int = 0
    bytes_copied: int = 0
    retries: int = 0
    sdk_retries: int = 0
    throttled: int = 0
    stalls: int = 0
    concurrency: int = 0
    min_concurrency_seen: int = 0
    paced_requests: int = 0
    paced_seconds: float = 0.0
