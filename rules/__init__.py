"""trainlint's rules, one module per family. Every ``Rule`` subclass here is registered by id."""
