"""kvpool: the Python client of kvpoold, a KV-cache service that stores LLM keys and values in
2 bits (OSCAR rotation + INT2) and computes decode attention over them.

    from kvpool import Client, DType, KvpoolError
    client = Client("127.0.0.1:50051")

- kvpool.client.Client: one method per kvpool.v1 RPC (numpy in and out, torch via DLPack);
- kvpool.stream.AppendStream: the layer-wise push;
- kvpool.errors.KvpoolError: the one exception type (gRPC code, RPC, reason);
- kvpool.options: deadlines, retries, TLS and token credentials;
- kvpool.placement: scale-out placement (membership epoch, placement keys, owners), as in C++;
- kvpool.routing.RoutingClient: one client over many daemons (placement, redirects, fan-out);
- kvpool.membership: membership targets (list or dns:///NAME:PORT) and the health probe;
- kvpool.attention: LSE merge of partial attentions, dense reference attention;
- kvpool.attention_backend: kvpool's decode attention kernel over local blocks (ctypes over
  libkvpool_attention.so; numpy, torch or DLPack in), an engine attention backend;
- kvpool.local_daemon.LocalDaemon: a kvpoold process on loopback;
- kvpool.connectors: vLLM KV connector, SGLang HiCache storage backend, remote attention.
"""

from kvpool.attention import dense_attention, merge_attention
from kvpool.client import Attention, BlocksRead, Client, KvRead, ModelDescription
from kvpool.errors import RETRYABLE_CODES, KvpoolError
from kvpool.options import NO_RETRY, ClientOptions, RetryPolicy, TlsOptions
from kvpool.routing import RoutingClient, RoutingOptions
from kvpool.stream import AppendStream
from kvpool.tensors import DType

__version__ = "0.1.0"

__all__ = [
    "AppendStream", "Attention", "BlocksRead", "Client", "ClientOptions", "DType", "KvRead",
    "KvpoolError", "ModelDescription", "NO_RETRY", "RETRYABLE_CODES", "RetryPolicy",
    "RoutingClient", "RoutingOptions", "TlsOptions", "dense_attention", "merge_attention",
]
