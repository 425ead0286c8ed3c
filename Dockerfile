# One image for every irisfed service (router, tick, peer-agent, migrate).
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml setup.py README.md ./
COPY shared ./shared
COPY services ./services
COPY migrations ./migrations
COPY irisfed ./irisfed
# For the CLI's irisfed up, chaos and bench (a few hundred KB; the services never import them).
COPY tooling ./tooling
COPY bench ./bench
# uid 10001: `irisfed compose-secrets` gives the secret files to this user (they are 0600).
RUN pip install --no-cache-dir . && useradd --create-home --uid 10001 irisfed
COPY deploy/federation.toml /etc/irisfed/federation.toml
USER irisfed
ENV IRISFED_CONFIG=/etc/irisfed/federation.toml
ENTRYPOINT []
CMD ["irisfed", "--help"]
