"""Standalone serving: a backend or a pool of replicas behind one async `Service`
interface, the HTTP server in front of it, and the clients that reach it."""
