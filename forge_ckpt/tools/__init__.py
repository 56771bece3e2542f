"""What the `forge-ckpt` commands compute, apart from how the CLI shows it: the JSON reports
(`report`), step comparison (`diff`) and progress display (`progress`)."""
