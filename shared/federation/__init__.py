"""Federation routing: peers, their reachability, and the submit-time classify rules."""
