"""Data: the formats rows are read in, tokenizing, packing, prepared shards, mixtures and the sample order."""
