# One image for every irisfed service (router, tick, peer-agent, migrate).
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY shared ./shared
COPY services ./services
COPY migrations ./migrations
COPY irisfed ./irisfed
# uid 10001: `irisfed compose-secrets` gives the secret files to this user (they are 0600).
RUN pip install --no-cache-dir . && useradd --create-home --uid 10001 irisfed
COPY deploy/federation.toml /etc/irisfed/federation.toml
USER irisfed
ENV IRISFED_CONFIG=/etc/irisfed/federation.toml
ENTRYPOINT []
CMD ["irisfed", "--help"]
