"""NATS server configuration for meshserve deployments: accounts, users and permissions.

``ops.nats.accounts`` holds the one definition of what every meshserve service (and an
external NATS API client) may publish and subscribe to; the checked-in configs beside it
(``accounts.conf``, ``cluster.conf``, ``PERMISSIONS.md``) are generated from it.
"""
