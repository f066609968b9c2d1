"""remote-g2 against the systems a user would pick instead (Mooncake Store, Dynamo, raw NIXL)."""
