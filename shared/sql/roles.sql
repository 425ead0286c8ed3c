-- Queries on login roles and `peer_roles` (which peer each agent's login acts as;
-- migration 0003). The role statements themselves (CREATE/ALTER ROLE, GRANT) take
-- no parameters and are built by the store.

-- login_role_exists --
-- Whether a login role of this name exists already (then it is altered, not created).
SELECT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = $1);

-- peer_role_upsert --
-- Map login role $1 to peer $2: row security lets it see and move only that peer's rows.
INSERT INTO peer_roles (role_name, peer_id) VALUES ($1, $2)
ON CONFLICT (role_name) DO UPDATE SET peer_id = EXCLUDED.peer_id;
