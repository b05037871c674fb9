"""`fairshare gateway` and `fairshare keys`: command line of the OpenAI-compatible gateway.

Gateway
-------
::

    fairshare gateway [--host 127.0.0.1] [--port 8000]
                      [--tenants FILE]                  # tenants YAML (see fairshare/config.py)
                      [--workers host:port[,host:port]] # gRPC workers, comma-separated
                      [--redis-url redis://127.0.0.1:6379/0]
                      [--secret-file FILE]              # server secret (alternative: FAIRSHARE_SECRET)
                      [--keys-file FILE]                # default: <tenants stem>.keys.yaml next to FILE
                      [--tokenizer DIR]                 # optional local tokenizer.json (+ chat template);
                                                        # default: taken from the worker (GetModelInfo)
                      [--lease-ttl-s 15] [--log-level info]

Every flag has an environment variable read with pydantic-settings (flags win over env):
``FAIRSHARE_HOST``, ``FAIRSHARE_PORT``, ``FAIRSHARE_TENANTS_FILE``, ``FAIRSHARE_WORKERS``
(comma-separated), ``FAIRSHARE_REDIS_URL``, ``FAIRSHARE_SECRET`` (the secret itself),
``FAIRSHARE_SECRET_FILE``, ``FAIRSHARE_KEYS_FILE``, ``FAIRSHARE_TOKENIZER``,
``FAIRSHARE_LEASE_TTL_S``, ``FAIRSHARE_LOG_LEVEL``. The gateway refuses to start without a secret.
It listens once it has reached at least one worker (``/readyz`` answers 200 when a worker is
SERVING and Redis answers PING; ``/healthz`` answers 200 while the process runs).

Keys
----
::

    fairshare keys create --tenant ID --tenants FILE [--secret-file FILE] [--keys-file FILE]
    fairshare keys list   --tenants FILE [--keys-file FILE]
    fairshare keys revoke --tenants FILE --key-id KID [--keys-file FILE]

``keys create`` prints the new key (``sk-fs-...``) once on stdout (one line, nothing else) and stores
only its HMAC-SHA256 digest under the server secret in the **keys file** (default
``<tenants file stem>.keys.yaml`` in the tenants file's directory, e.g. ``tenants.yaml`` ->
``tenants.keys.yaml``); the tenants file itself is never rewritten. When ``--secret-file`` names a
file that does not exist yet, ``keys create`` creates it (random 32 bytes, hex, mode 0600), so
``fairshare up`` can run ``keys create --secret-file S`` and then ``gateway --secret-file S``.
"""

from __future__ import annotations
