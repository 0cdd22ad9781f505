"""The contract: the hooks a backend implements (`hookspecs`), the request and result schemas
(`schemas`), the typed errors (`errors`), their conversion from and to plain data
(`convert`), and how backends are found (`plugins`)."""
