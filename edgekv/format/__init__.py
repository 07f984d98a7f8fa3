"""What a bundle is (manifest, graph I/O names) and the KV schemes: numpy only, shared by the exporter and the runtime."""
