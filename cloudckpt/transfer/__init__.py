"""Concurrent transfers: bounded requests and bytes, bandwidth cap, AIMD throttling,
retries, a stall watchdog, progress plug-ins and CRC32C on the way.

    from cloudckpt.transfer import TransferConfig, TransferEngine
    with TransferEngine(TransferConfig(max_concurrency=16)) as engine:
        results = engine.upload_all([("/tmp/a.bin", "s3://bucket/run/a.bin"), ...])
"""

from .bandwidth import TokenBucket
from .checksum import Crc32cReader, crc32c_bytes, crc32c_file
from .config import TransferConfig, TransferResult, TransferStats
from .engine import TransferEngine
from .executor import SerialExecutor
from .pacing import RequestPacer
from .progress import ProgressSubscriber, TqdmProgress

__all__ = [
    "Crc32cReader",
    "ProgressSubscriber",
    "RequestPacer",
    "SerialExecutor",
    "TokenBucket",
    "TqdmProgress",
    "TransferConfig",
    "TransferEngine",
    "TransferResult",
    "TransferStats",
    "crc32c_bytes",
    "crc32c_file",
]
